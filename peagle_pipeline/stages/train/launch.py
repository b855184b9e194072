"""`train --nproc-per-node N`: N ranks of the same train command on this machine, ending with the run's exit code.

`torchrun --standalone --nproc-per-node N` starts the same ranks but speaks over them at the end: it exits 1
whatever they exit with, prints its ChildFailedError summary after rank 0's line, ends a Ctrl-C in its
SignalException traceback, and sends SIGTERM to every other rank the moment one fails, so that a refusal every
rank meets (exit 5, 6) can come back as 143 from a rank 0 stopped before it got there. Torch's in-process launcher
(`torch.distributed.launcher.api.elastic_launch`) runs the same agent and process context (that SIGTERM included),
so the ranks are started here instead, with torchrun's environment:

- each rank runs `python -u -m peagle_pipeline.cli` with the command line less `--nproc-per-node N`, in a session
  of its own as under torchrun (a terminal's Ctrl-C reaches the launcher, which passes it on), with RANK,
  LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_* and
  `runtime.LAUNCHER_ENV`. They meet at a TCP store this process hosts on a port the kernel chose, as torchrun's
  agent does (TORCHELASTIC_USE_AGENT_STORE): no port is picked and freed for rank 0 to bind later. An unset
  OMP_NUM_THREADS becomes the usable CPUs shared out (torchrun: 1, with a warning). Their stdout and stderr are
  the launcher's: rank 0 speaks for the run.
- a stop signal (SIGINT, SIGTERM) goes to every rank, which finishes its step, saves and exits 130 or 143; a second
  one too (the ranks then stop at once, keeping their last checkpoint); a third kills them. A rank still starting
  Python gets it once its `cli.main()` runs (`_ready`), so that it says one line, not a KeyboardInterrupt traceback.
- when a rank fails, the others get GRACE_S to end by themselves (their next collective fails, or they meet the
  same refusal), then SIGTERM, then SIGKILL KILL_S later. A rank killed by a signal has its process group killed
  at once: its DataLoader workers would keep its sockets, so the others' collectives open, for seconds more.
- the exit code is the run's (`outcome`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from subprocess import DEVNULL

from peagle_pipeline.config import TrainConfig
from peagle_pipeline.errors import BadConfig, PeagleError, RankLost, Reported
from peagle_pipeline.hardware import usable_cpus
from peagle_pipeline.preemption import STOP_SIGNALS, stop_error
from peagle_pipeline.runtime import LAUNCHER_ENV
from peagle_pipeline.stages.train.distributed import rank_lost

__all__ = ["run", "rank_command", "rank_env", "outcome", "FLAG", "GRACE_S", "KILL_S"]

FLAG = "--nproc-per-node"
GRACE_S = 10.0  # after a rank failed: how long the others may take to end by themselves before SIGTERM
KILL_S = 20.0  # then until SIGKILL (30 s in all, as torch elastic's default shutdown timeout)
_POLL_S = 0.05
_STOPPED = (130, 143)


def run(cfg: TrainConfig, nproc: int, command_line: Sequence[str]) -> None:
    """Run `nproc` ranks of `command_line` (the train command line as given, `--nproc-per-node N` included) to
    their end; returns when every rank exited 0.

    Raises:
        BadConfig: `nproc` below 1, or this process is a rank of a distributed run already.
        Reported: rank 0 failed and printed why: its exit code, nothing printed here.
        RankLost: a rank died (exit 13): one line naming it, how it ended, the last checkpoint, the resume.
        Interrupted, Terminated: stopped, with a rank that ended otherwise than by the stop.
    """
    _check(nproc)
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    argv = [sys.executable, "-u", "-m", "peagle_pipeline.cli", *rank_command(command_line)]
    base = _base_env(nproc, store.port)
    procs: list[subprocess.Popen[bytes]] = []
    with _caught_stops() as stops:
        try:
            for rank in range(nproc):  # each in a session of its own, as torchrun starts them
                env = rank_env(base, rank)
                procs.append(subprocess.Popen(argv, env=env, stdin=DEVNULL, start_new_session=True))
            ended, forced = _wait(procs, stops)
        finally:
            for proc in procs:  # only a rank still running: none, unless the launcher itself failed
                _signal(proc, signal.SIGKILL)
    del store
    err = outcome([p.returncode for p in procs], ended, stops[0] if stops else 0, cfg.output, forced)
    if err is not None:
        raise err


def rank_command(command_line: Sequence[str]) -> list[str]:
    """The command line of every rank: `command_line` less `--nproc-per-node N` (or `--nproc-per-node=N`)."""
    out: list[str] = []
    skip = False
    for arg in command_line:
        if skip:
            skip = False
        elif arg == FLAG:
            skip = True
        elif not arg.startswith(FLAG + "="):
            out.append(arg)
    return out


def rank_env(base: dict[str, str], rank: int) -> dict[str, str]:
    """The environment of rank `rank` (one machine: the local rank is the rank)."""
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}


def outcome(
    codes: Sequence[int], ended: Sequence[int], stop: int, output: str, forced: Collection[int] = ()
) -> PeagleError | None:
    """The error the run ends with (None: every rank exited 0).

    Args:
        codes: each rank's exit status (negative: killed by that signal, as `subprocess` gives it).
        ended: the ranks in the order they were seen to end.
        stop: the first stop signal passed on to the ranks (0: none).
        output: the run directory (for the line of a lost rank).
        forced: the ranks the launcher ended itself, after another failed (`GRACE_S`, `KILL_S`).

    Rank 0's own failure (it printed the line) is `Reported` with its code, and so is a stop it obeyed (130, 143,
    or killed by the stop's own signal), unless another rank failed first and rank 0 was stopped after it. Else
    rank 0 lost a rank (13: it leaves the line to the launcher) or died itself: `RankLost` names the rank that
    died (killed by a signal first, then one that failed on its own, in the order they ended) and how; after a
    stop, the stop's error says it. A rank the launcher had to end is named last, as still running.
    """
    if not any(codes):
        return None
    zero, obeyed = codes[0], (*_STOPPED, -stop) if stop else ()
    failed = [r for r in ended if codes[r] != 0]
    if stop and zero in obeyed:
        return Reported(zero if zero > 0 else 128 + stop)
    if zero > 0 and zero != RankLost.exit_code and (zero not in _STOPPED or failed[0] == 0):
        return Reported(zero)
    killed = [r for r in failed if codes[r] < 0 and codes[r] not in obeyed and r not in forced]
    own = [r for r in failed if codes[r] not in (RankLost.exit_code, *_STOPPED, *obeyed) and r not in forced]
    stuck = [r for r in failed if r in forced]
    who = (killed or own or stuck or failed)[0]
    how = f"was still running {GRACE_S + KILL_S:.0f} s after another rank ended, and was killed"
    how = how if who in forced else _how(codes[who])
    lost = rank_lost(output, f"rank {who}", len(codes), how, "command")
    return stop_error(stop, f": {lost}") if stop else lost


def _how(code: int) -> str:
    if code >= 0:
        return f"ended with exit code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _check(nproc: int) -> None:
    if nproc < 1:
        raise BadConfig(f"{FLAG} must be at least 1, got {nproc}")
    if LAUNCHER_ENV in os.environ or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise BadConfig(f"{FLAG} starts the ranks itself: run it as one process, not under torchrun")


def _base_env(nproc: int, port: int) -> dict[str, str]:
    """torchrun's environment of every rank (the rank's own variables: `rank_env`), this launcher's mark."""
    env = dict(os.environ)
    env.update(
        {
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "ROLE_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            LAUNCHER_ENV: "1",
        }
    )
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))
    return env


@contextlib.contextmanager
def _caught_stops() -> Iterator[list[int]]:
    """SIGINT and SIGTERM only noted (the list yielded, in order) while the ranks run: `_wait` passes them on."""
    stops: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: stops.append(signum)) for s in STOP_SIGNALS}
    try:
        yield stops
    finally:
        for s, handler in previous.items():
            if handler is not None:
                signal.signal(s, handler)


def _wait(procs: Sequence[subprocess.Popen[bytes]], stops: list[int]) -> tuple[list[int], set[int]]:
    """Wait for every rank to end, passing each stop on to each rank once it is ready for it (`_ready`; a third
    stop kills them all); after a rank ended otherwise than with 0, SIGTERM and then SIGKILL the ranks still
    running (`GRACE_S`, `KILL_S`). Returns the ranks in the order they ended, and those ended that way."""
    ended: list[int] = []
    passed = [0] * len(procs)  # stops passed on to each rank
    forced: set[int] = set()
    failed_at: float | None = None
    while True:
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended.append(rank)
                if proc.returncode < 0:  # killed: its DataLoader workers still hold its sockets to the others
                    _signal(proc, signal.SIGKILL, group_only=True)
                if proc.returncode != 0 and failed_at is None:
                    failed_at = time.monotonic()
        if len(ended) == len(procs):
            return ended, forced
        for rank, proc in enumerate(procs):
            if len(stops) >= 3:
                _signal(proc, signal.SIGKILL)
            elif passed[rank] < len(stops) and _ready(proc.pid):
                _signal(proc, stops[passed[rank]])
                passed[rank] += 1
        late = 0.0 if failed_at is None else time.monotonic() - failed_at
        if late > GRACE_S:  # SIGTERM once, then SIGKILL
            kill = late > GRACE_S + KILL_S
            for rank, proc in enumerate(procs):
                if proc.poll() is None and (kill or rank not in forced):
                    _signal(proc, signal.SIGKILL if kill else signal.SIGTERM)
                    forced.add(rank)
        time.sleep(_POLL_S)


def _ready(pid: int) -> bool:
    """Whether rank `pid` runs `cli.main()`, which catches SIGTERM from its start (`preemption.install`) and makes
    a stop one line: before it, while Python starts and imports, a Ctrl-C ends the rank in a KeyboardInterrupt
    traceback. (No /proc: ready.)"""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next((line.split()[1] for line in status if line.startswith("SigCgt:")), None)
    except OSError:
        return True
    return caught is None or bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def _signal(proc: subprocess.Popen[bytes], signum: int, group_only: bool = False) -> None:
    """Signal a rank still running (or, `group_only`, what is left of an ended rank's group) with its process
    group (its DataLoader workers ignore stop signals)."""
    if group_only or proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)
