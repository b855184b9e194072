"""Atomic, resumable training checkpoints in a run directory.

Layout (constants below are the only place these names are spelled):

    RUN/checkpoints/
      step-00000050/      model.safetensors (fp32, export key names), optimizer.pt, state.pt, meta.json
      step-00000100/      (a directory only exists under this name once complete: written as step-N.tmp/, renamed)
      latest              text "step-00000100", replaced atomically after the rename
      best                text "step-00000050": the checkpoint with the best eval acceptance (kept apart from pruning)

Completeness rule (torchtitan's): a `step-N` directory without the `.tmp` suffix is complete, because the rename
is the last thing the writer does; `load_latest()` takes the highest such step and never trusts `latest` alone.
The only writer is rank 0. Never touches model code or data: it stores what the trainer hands it.

Test hook: PEAGLE_TEST_CKPT_SLEEP=<seconds> sleeps between the files of a checkpoint write, so a crash test can
kill -9 the process mid-write. It has no other effect.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from peagle_pipeline.errors import BadInput, CorruptCache
from peagle_pipeline.runtime import (
    atomic_write_text,
    fsync_dir,
    fsync_file,
    make_readable,
    pause_for_crash_test,
    raise_if_no_space,
)
from peagle_pipeline.stages.run_layout import CHECKPOINTS_DIR

__all__ = [
    "CHECKPOINTS_DIR",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "META_FILE",
    "LATEST",
    "BEST",
    "Checkpoint",
    "CheckpointManager",
    "step_dir_name",
    "save_tensors",
    "save_torch",
]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
LATEST = "latest"
BEST = "best"
SLEEP_ENV = "PEAGLE_TEST_CKPT_SLEEP"

_STEP_RE = re.compile(r"^step-(\d+)$")
log = logging.getLogger(__name__)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class Checkpoint:
    """What one checkpoint holds, as loaded (tensors on CPU).

    Attributes:
        step: optimizer steps completed.
        model: fp32 state dict (export key names).
        optimizer: `optimizer.state_dict()` or None (model-only loads).
        state: trainer state (data cursor, scheduler step, RNG states, best metric, counters).
        meta: small JSON facts (step, time, eval metrics).
        path: the directory it was read from.
    """

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    state: dict[str, Any]
    meta: dict[str, Any]
    path: Path


class _Recorder:
    """A file wrapper that remembers the OSError of a failed write (torch.save reports it as a bare
    RuntimeError, losing the errno that says "disk full")."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.f.write(data))
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def save_torch(obj: Any, path: Path) -> None:
    """torch.save to `path`, fsynced; a failed write raises its OSError (ENOSPC, EFBIG, ...), not RuntimeError."""
    with open(path, "wb") as f:
        rec = _Recorder(f)
        try:
            torch.save(obj, rec)  # type: ignore[arg-type]  # a binary file-like object
        except RuntimeError:
            if rec.error is not None:
                raise rec.error from None
            raise
        f.flush()
        os.fsync(f.fileno())


def save_tensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """safetensors save_file to `path`, fsynced; an I/O failure raises OSError with its errno (the Rust writer
    reports it as SafetensorError text "... (os error 28)")."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as err:  # SafetensorError is not importable as a public name
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    fsync_file(path)


class CheckpointManager:
    """Writes, prunes and finds checkpoints under `run_dir/checkpoints` (rank 0 writes; any rank may read)."""

    def __init__(self, run_dir: str | os.PathLike[str], keep: int) -> None:
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.keep = keep

    # ---- discovery -------------------------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        """Steps of every complete checkpoint, ascending."""
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            m = _STEP_RE.match(entry.name)
            if m and entry.is_dir() and (entry / META_FILE).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def best_step(self) -> int | None:
        """The step the `best` pointer names, if that checkpoint is complete."""
        pointer = self.root / BEST
        if not pointer.is_file():
            return None
        m = _STEP_RE.match(pointer.read_text().strip())
        if m is None or int(m.group(1)) not in self.complete_steps():
            return None
        return int(m.group(1))

    def resolve(self, which: str) -> Path:
        """`latest`, `best` or `step-N` to a complete checkpoint directory.

        Raises:
            BadInput: no such complete checkpoint.
        """
        steps = self.complete_steps()
        if which == "latest":
            if not steps:
                raise BadInput(f"no complete checkpoint in {self.root}")
            return self.root / step_dir_name(steps[-1])
        if which == "best":
            best = self.best_step()
            if best is None:
                if not steps:
                    raise BadInput(f"no complete checkpoint in {self.root}")
                log.warning("no best checkpoint recorded in %s; using the latest", self.root)
                best = steps[-1]
            return self.root / step_dir_name(best)
        m = re.match(r"^step-(\d+)$", which)
        if m is None:
            raise BadInput(f"checkpoint must be latest, best or step-N, got {which!r}")
        if int(m.group(1)) not in steps:
            raise BadInput(
                f"no complete checkpoint {which} in {self.root} (have: "
                f"{', '.join(str(s) for s in steps) or 'none'})"
            )
        return self.root / step_dir_name(int(m.group(1)))

    # ---- writing ---------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        state: dict[str, Any],
        meta: dict[str, Any],
        best: bool = False,
    ) -> Path:
        """Write `step-N/` atomically (tmp dir, fsync each file, rename), update `latest` (and `best`), prune.

        Re-saving an existing step (e.g. eval and save on the same step) replaces it atomically.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dir_name(step)
        tmp = self.root / (step_dir_name(step) + ".tmp")
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            weights = {k: v.detach().to("cpu").contiguous() for k, v in model.items()}
            save_tensors(weights, tmp / MODEL_FILE)
            make_readable(tmp / MODEL_FILE)  # safetensors writes 0600
            pause_for_crash_test(SLEEP_ENV)
            save_torch(optimizer, tmp / OPTIMIZER_FILE)
            pause_for_crash_test(SLEEP_ENV)
            save_torch(state, tmp / STATE_FILE)
            with open(tmp / META_FILE, "w") as f:
                f.write(json.dumps({"step": step, "time": time.time(), **meta}, indent=2))
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            if final.exists():  # same step written twice: move the old one aside first, then drop it
                old = self.root / (step_dir_name(step) + ".old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(self.root)
            atomic_write_text(self.root / LATEST, final.name + "\n")
            if best:
                atomic_write_text(self.root / BEST, final.name + "\n")
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves no half checkpoint behind
            raise_if_no_space(err, str(final))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    def prune(self) -> None:
        """Keep the newest `keep` complete checkpoints and the best one; remove leftovers of killed writes."""
        steps = self.complete_steps()
        best = self.best_step()
        for s in steps[: max(0, len(steps) - self.keep)]:
            if s != best:
                shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)
        for entry in self.root.iterdir():
            if entry.is_dir() and (entry.name.endswith(".tmp") or entry.name.endswith(".old")):
                shutil.rmtree(entry, ignore_errors=True)

    # ---- reading ---------------------------------------------------------------------------------------------
    def load(self, path: Path, with_optimizer: bool = True) -> Checkpoint:
        """Read one complete checkpoint directory onto the CPU.

        Raises:
            CorruptCache: a file of the checkpoint cannot be read (names the file and the older checkpoints).
        """
        name = META_FILE
        try:
            meta = json.loads((path / META_FILE).read_text())
            step = int(meta["step"])
            name = MODEL_FILE
            model = load_file(str(path / MODEL_FILE))
            name = STATE_FILE
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
            name = OPTIMIZER_FILE
            optim = (
                torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
                if with_optimizer
                else None
            )
        except Exception as err:  # safetensors, pickle, zip, json, key errors: all mean a damaged file
            why = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
            older = [s for s in self.complete_steps() if step_dir_name(s) != path.name]
            hint = (
                f"; rename it to {path.name}.bad to use {step_dir_name(older[-1])}"
                if older
                else "; no other complete checkpoint"
            )
            raise CorruptCache(f"checkpoint {path}/{name} cannot be read ({why}){hint}") from None
        return Checkpoint(step=step, model=model, optimizer=optim, state=state, meta=meta, path=path)

    def load_latest(self, with_optimizer: bool = True) -> Checkpoint | None:
        """The highest complete checkpoint, or None when there is none."""
        steps = self.complete_steps()
        if not steps:
            return None
        return self.load(self.root / step_dir_name(steps[-1]), with_optimizer=with_optimizer)
