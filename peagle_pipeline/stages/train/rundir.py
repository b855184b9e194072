"""The training run directory: what a run records about itself, and the checks before (re)starting one.

`train.yaml` (resolved settings, what --resume compares), `run.json` (world size, global batch, the cache's real
path and identity, argv, versions and total steps per start). A run *has trained* once it holds a complete checkpoint or a
train record in metrics.jsonl; a folder whose run never trained (its start failed, or it was stopped before its
first step) does not block the next start, with or without --resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from peagle_pipeline.cache import layout
from peagle_pipeline.config import TrainConfig, to_dict
from peagle_pipeline.core.settings import setting_differences
from peagle_pipeline.errors import BadInput, OutputExists, ResumeMismatch
from peagle_pipeline.runtime import atomic_write_json, atomic_write_text
from peagle_pipeline.stages.run_layout import (
    CHECKPOINTS_DIR,
    EXPORT_DIR,
    LOCK_FILE,
    METRICS_FILE,
    RUN_JSON,
    TRAIN_YAML,
)

__all__ = [
    "TRAIN_YAML",
    "RUN_JSON",
    "EXPORT_DIR",
    "LOCK_FILE",
    "RESUME_FREE",
    "EXTENDABLE",
    "cache_identity",
    "check_output_path",
    "global_batch_tokens",
    "has_trained",
    "prepare_output",
    "write_run_files",
]

# Settings a resume may change: they do not alter the weights trained so far (where the run lives, how often it
# logs, evaluates and saves, how many checkpoints it keeps, the device, the reader processes, whether a corrupt
# sample met from now on is skipped: the advice of the corrupt-sample error is `--resume --skip-corrupt`).
RESUME_FREE = frozenset(
    {
        "resume",
        "output",
        "num_workers",
        "log_every",
        "report_to",  # where the metrics go
        "export",
        "device",
        "fsdp",  # checkpoints have the same form with and without it
        "keep_checkpoints",
        "save_every",
        "eval_every",
        "max_bad_steps",
        "skip_corrupt",
    }
)
# Settings a resume may change to extend (or shorten) the run: the schedule is recomputed for the new total.
EXTENDABLE = frozenset({"steps", "epochs"})

log = logging.getLogger(__name__)


def cache_identity(cache: str) -> str | None:
    """sha256 of the cache's cache.json (written once when the cache is created): same bytes, same cache.

    None when it cannot be read locally (an object-store URL, or no cache there).
    """
    try:
        return hashlib.sha256((Path(cache) / layout.CACHE_META).read_bytes()).hexdigest()
    except OSError:
        return None


def global_batch_tokens(cfg: TrainConfig, world: int) -> int:
    """Packing budget of one optimizer step over all ranks: tokens_per_step x ranks x grad_accum."""
    return cfg.tokens_per_step * world * cfg.grad_accum


def check_output_path(output: str) -> None:
    """Raises BadInput when --output names an existing file (a run directory is needed)."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--output {out} is a file: give a directory for the run")


def has_trained(out: Path) -> bool:
    """True once the run in `out` completed a step: a complete checkpoint, or a train record in metrics.jsonl."""
    ckpts = out / CHECKPOINTS_DIR
    if ckpts.is_dir() and any(
        p.is_dir() and p.name.startswith("step-") and not p.suffix for p in ckpts.iterdir()
    ):
        return True
    metrics = out / METRICS_FILE
    return metrics.is_file() and '"kind": "train"' in metrics.read_text(encoding="utf-8", errors="replace")


def prepare_output(cfg: TrainConfig, world: int) -> bool:
    """Check the run directory against the request; True when a previous run is continued.

    Raises:
        OutputExists: a run that trained, without --resume; or a non-empty folder that holds no run.
        BadInput: --resume but no run there.
        ResumeMismatch: --resume with settings other than the run's train.yaml (names them), or another cache.
    """
    import yaml

    out = Path(cfg.output)
    check_output_path(cfg.output)
    has_run = (out / TRAIN_YAML).is_file()
    trained = has_run and has_trained(out)
    if has_run and not trained:  # an earlier start failed or stopped before its first step: start again
        log.info("%s holds a run that never trained; starting it again with these settings", out)
        return False
    if not cfg.resume:
        if trained:
            raise OutputExists(
                f"{out} already holds a training run: add --resume to continue it, or choose another --output"
            )
        if out.exists() and any(p.name != LOCK_FILE for p in out.iterdir()):
            raise OutputExists(f"{out} is not empty and holds no training run: choose another --output")
        return False
    if not has_run:
        raise BadInput(f"nothing to resume in {out} (no {TRAIN_YAML}): drop --resume to start a new run")
    saved = (yaml.safe_load((out / TRAIN_YAML).read_text()) or {}).get("train", {})
    now = to_dict(cfg)
    facts = _read_run_json(out)
    if "grad_accum" not in saved and "micro_steps" in facts:  # a run from before grad_accum was a setting
        saved["grad_accum"] = facts["micro_steps"]
    for f in dataclasses.fields(TrainConfig):  # a setting newer than the run: the run had its default
        if f.name in saved:
            continue
        if f.default is not dataclasses.MISSING:
            saved[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # a list setting (extra_cache)
            saved[f.name] = f.default_factory()
    saved.update(world_size=facts.get("world_size", world))
    now.update(world_size=world)
    free = RESUME_FREE | EXTENDABLE | {"cache"}
    diff = setting_differences(saved, now, ignore=free, ordered=True)
    if diff:
        detail = ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in diff)
        raise ResumeMismatch(f"cannot resume {out}: settings differ from its {TRAIN_YAML}: {detail}")
    _check_same_cache(out, str(saved.get("cache", "")), cfg.cache, facts)
    return True


def _read_run_json(out: Path) -> dict[str, Any]:
    try:
        facts = json.loads((out / RUN_JSON).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        raise BadInput(f"{out / RUN_JSON} is damaged (not JSON): restore it or start a new run") from None
    return facts if isinstance(facts, dict) else {}


def _check_same_cache(out: Path, saved: str, now: str, facts: dict[str, Any]) -> None:
    """The resumed run must read the cache it started on: same real path, or the same cache.json bytes (a moved
    or copied cache). A cache re-extracted in place (other cache.json) is refused even under the same path."""
    saved_real = facts.get("cache_realpath") or os.path.realpath(saved)
    saved_id, now_id = facts.get("cache_identity"), cache_identity(now)
    same_path = os.path.realpath(now) == saved_real
    if saved_id is not None and now_id is not None:
        same = saved_id == now_id
    else:  # a run from before identities were recorded, or a cache that cannot be read here
        same = same_path
    if not same:
        why = "another cache (its cache.json differs)" if same_path else "another cache"
        raise ResumeMismatch(f"cannot resume {out}: cache ({saved!r} -> {now!r}) is {why}")
    if not same_path:
        log.info("cache %s moved to %s (same cache.json); resuming on it", saved, now)


def write_run_files(cfg: TrainConfig, world: int, resumed: bool, total_steps: int) -> None:
    """Write train.yaml (the current settings) and append this start to run.json (argv, versions, total steps,
    the global batch)."""
    from importlib.metadata import version

    import torch
    import yaml

    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    head = (
        "# Resolved settings of this run (compared by --resume). Use it as a pipeline file: -c train.yaml\n"
    )
    settings = {**to_dict(cfg), "resume": False}
    atomic_write_text(out / TRAIN_YAML, head + yaml.safe_dump({"train": settings}, sort_keys=False))
    facts = _read_run_json(out) if resumed else {}
    facts.setdefault("starts", [])
    from peagle_pipeline import __version__

    facts.update(
        world_size=world,
        global_batch_tokens=global_batch_tokens(cfg, world),
        cache_realpath=os.path.realpath(cfg.cache),
        cache_identity=cache_identity(cfg.cache),
    )
    facts["starts"].append(
        {
            "argv": sys.argv,
            "time": time.time(),
            "resumed": resumed,
            "total_steps": total_steps,
            "versions": {
                "peagle_pipeline": __version__,
                "torch": torch.__version__,
                "transformers": version("transformers"),  # not imported: training never needs it
                "python": platform.python_version(),
            },
        }
    )
    atomic_write_json(out / RUN_JSON, facts)
