"""Writes that fail: a full disk during training or export and read-only output folders give
one error line with the documented exit code (9 disk full, 2 unusable path), never a traceback, and leave no
half-written `.tmp` folder; a full disk during training resumes once space is back.

Disk full comes two real ways: RLIMIT_FSIZE (writes fail with EFBIG, works for any user) and, where this process
may mount, a small tmpfs (ENOSPC). Read-only folders are a read-only bind mount (root ignores file modes) or a
chmod (other users).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_argv import PEAGLE, fast_cli, small_train_flags
from cli_run import peagle

pytestmark = pytest.mark.slow

FLAGS = small_train_flags(depths=2, tokens_per_step=256, steps=3, save_every=2, num_workers=0, eval_samples=4)
FSIZE = 100_000  # bytes: the run's small files fit, a checkpoint's model.safetensors (~250 kB) does not


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PEAGLE_DEBUG", None)
    return env


def _capped(limit: int):  # type: ignore[no-untyped-def]
    def pre() -> None:  # in the child: a write past the limit fails with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


def _run(argv: list[str], limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """`peagle-pipeline ARGV` to completion; with a file-size limit, set between fork and exec of a fresh one."""
    env = _env()
    return subprocess.run(
        [*PEAGLE, *argv] if limit else fast_cli([*PEAGLE, *argv], env),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_capped(limit) if limit else None,
    )


def _one_error(proc: subprocess.CompletedProcess[str], code: int, *parts: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    report = f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.returncode == code and "Traceback" not in proc.stderr and len(lines) == 1, report
    for part in parts:
        assert part in lines[0], report
    return lines[0]


@contextlib.contextmanager
def _small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]).returncode
    ):
        pytest.skip(
            "cannot mount a tmpfs here (ENOSPC is covered by the EFBIG runs and tests/unit/test_errors.py)"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[Path]:
    """`path` (a folder) seen read-only: a read-only bind mount for root, else its modes without write bits."""
    if os.geteuid() == 0:
        ro = path.with_name(path.name + "-ro")
        ro.mkdir()
        if subprocess.run(["mount", "--bind", str(path), str(ro)]).returncode:
            pytest.skip("cannot bind-mount here")
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
            yield ro
        finally:
            subprocess.run(["umount", str(ro)], check=True)
    else:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield path
        finally:
            for p, mode in modes.items():
                p.chmod(mode)


@pytest.fixture(scope="module")
def finished(tiny_cache: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    peagle("train", "--cache", str(tiny_cache), "--output", str(out), *FLAGS)
    return out


# ------------------------------------------------------------------------------------------------ disk full
def test_disk_full_during_training_is_exit_9_and_resumes(tiny_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--cache", str(tiny_cache), "--output", str(out), *FLAGS]
    # the same command alone would be refused (the folder holds a run): the advice names --resume
    _one_error(
        _run(argv, limit=FSIZE), 9, "no space left while writing", "checkpoints", "re-run it with --resume"
    )
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    again = _run([*argv, "--resume"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "checkpoints" / "step-00000003" / "meta.json").is_file()


def test_no_space_left_during_training_is_exit_9(tiny_cache: Path, tmp_path: Path) -> None:
    with _small_tmpfs(tmp_path / "mnt", "400k") as mnt:
        out = mnt / "run"
        proc = _run(["train", "--cache", str(tiny_cache), "--output", str(out), *FLAGS])
        line = _one_error(proc, 9, "no space left while writing")
        assert not [p for p in out.rglob("*") if ".tmp" in p.name]
        assert ("--resume" in line) == (out / "run.json").exists(), line


def test_no_space_left_during_training_with_a_loader_worker_ends_the_process(
    tiny_cache: Path, tmp_path: Path
) -> None:
    # With a loader worker (the default; it ignores SIGTERM), a run that stopped on an error hung in the
    # interpreter's exit, waiting for the worker. A real full disk here: RLIMIT_FSIZE would also cap the worker's
    # shared memory.
    flags = small_train_flags(
        depths=2, tokens_per_step=256, steps=3, save_every=2, num_workers=1, eval_samples=4
    )
    with _small_tmpfs(tmp_path / "mnt", "400k") as mnt:
        out = mnt / "run"
        proc = _run(["train", "--cache", str(tiny_cache), "--output", str(out), *flags])
        _one_error(proc, 9, "no space left while writing")


def test_full_shared_memory_in_the_loader_worker_is_exit_9_not_a_hang(
    tiny_cache: Path, tmp_path: Path
) -> None:
    # A /dev/shm too small for one packed row (a container's 64 MB default against rows of a wide target): the
    # DataLoader dropped the worker's row in its feeder thread with a printed traceback and the trainer waited
    # forever. A real small /dev/shm: a tmpfs mounted over it in a mount namespace of the run's own.
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting over /dev/shm needs root and unshare")
    flags = small_train_flags(depths=2, tokens_per_step=512, steps=3, num_workers=1, eval_samples=4)
    argv = ["train", "--cache", str(tiny_cache), "--output", str(tmp_path / "run"), *flags]
    mount_then_run = 'mount -t tmpfs -o size=128k tmpfs /dev/shm && exec "$@"'
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", mount_then_run, "sh", *PEAGLE, *argv],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    _one_error(proc, 9, "no room in shared memory (/dev/shm)", "--shm-size", "num_workers: 0")


def test_disk_full_during_export_is_exit_9_and_leaves_nothing(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "exp"
    _one_error(_run(["export", str(finished), "--output", str(out)], limit=FSIZE), 9, f"while writing {out}")
    assert list(tmp_path.iterdir()) == []  # neither the export nor its .exp.tmp-PID folder
    with _small_tmpfs(tmp_path / "mnt", "100k") as mnt:
        _one_error(_run(["export", str(finished), "--output", str(mnt / "exp")]), 9, "no space left")
        assert list(mnt.iterdir()) == []


# ------------------------------------------------------------------------------------------ read-only places
def test_read_only_outputs_are_one_line_errors(finished: Path, tiny_cache: Path, tmp_path: Path) -> None:
    parent = tmp_path / "place"
    parent.mkdir()
    run = shutil.copytree(finished, tmp_path / "run-copy")
    shutil.rmtree(run / "plots")
    with _read_only(parent) as ro:
        _one_error(
            _run(["train", "--cache", str(tiny_cache), "--output", str(ro / "run"), *FLAGS]), 2, str(ro)
        )
        _one_error(_run(["export", str(finished), "--output", str(ro / "exp")]), 2, str(ro))
    with _read_only(run) as ro_run:
        _one_error(_run(["plot", str(ro_run)]), 2, str(ro_run / "plots"))


# ------------------------------------------------------------------------------------------- unreadable files
def test_a_weight_file_this_user_may_not_read_is_permission_denied(
    tiny_model: Path, conversations, tmp_path
) -> None:
    """model.safetensors of mode 0600 owned by another user (as save_pretrained writes it, in a shared folder):
    "permission denied", not safetensors' "No such file or directory". Root reads any file, so the run drops the
    capabilities that let it (a real kernel refusal, as another user gets)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to stand for another user")
    model = shutil.copytree(tiny_model, tmp_path / "model")
    weights = model / "model.safetensors"
    os.chown(weights, 4321, 4321)
    weights.chmod(0o600)
    caps = "-dac_override,-dac_read_search"
    argv = ["extract", "--model", str(model), "--data", str(conversations), "--output", str(tmp_path / "c")]
    proc = subprocess.run(
        ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--", *PEAGLE, *argv],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _one_error(proc, 2, "permission denied", str(weights))
    assert "No such file" not in line and not (tmp_path / "c").exists()


def test_no_space_left_while_copying_the_targets_files_names_the_cache(
    tiny_model: Path, conversations, tmp_path
):
    """The copy of the target's files into CACHE/target fails: the line names where it could not write (the cache),
    not the model file it was reading; the new cache is removed. (The free-space check before the start would
    refuse this file system: it is turned off to reach the copy.)"""
    with _small_tmpfs(tmp_path / "mnt", "64k") as mnt:
        out = mnt / "cache"
        argv = ["extract", "--model", str(tiny_model), "--data", str(conversations), "--output", str(out)]
        argv.append("--no-space-check")
        line = _one_error(
            _run([*argv, "--compute-dtype", "fp32"]), 9, "no space left while writing", str(out)
        )
        assert str(tiny_model) not in line and not out.exists(), line
