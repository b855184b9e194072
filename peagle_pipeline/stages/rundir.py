"""The training run directory: what a run records about itself, and the checks before (re)starting one.

`train.yaml` (resolved settings, what --resume compares), `run.json` (world size, argv, versions per start).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from peagle_pipeline.config import TrainConfig, to_dict
from peagle_pipeline.errors import BadInput, OutputExists, ResumeMismatch
from peagle_pipeline.runtime import atomic_write_json, atomic_write_text

__all__ = [
    "TRAIN_YAML",
    "RUN_JSON",
    "EXPORT_DIR",
    "LOCK_FILE",
    "RESUME_IGNORED",
    "prepare_output",
    "write_run_files",
]

TRAIN_YAML = "train.yaml"
RUN_JSON = "run.json"
EXPORT_DIR = "export"
LOCK_FILE = "train.lock"
# Settings a resume may change: they do not alter the trained weights.
RESUME_IGNORED = frozenset({"resume", "num_workers", "log_every", "export"})


def prepare_output(cfg: TrainConfig, world: int, micro_steps: int) -> bool:
    """Check the run directory against the request; True when a previous run is continued.

    Raises:
        OutputExists: a non-empty output without --resume.
        BadInput: --resume but no run there.
        ResumeMismatch: --resume with settings other than the run's train.yaml (names them).
    """
    import yaml

    out = Path(cfg.output)
    has_run = (out / TRAIN_YAML).is_file()
    if not cfg.resume:
        if has_run:
            raise OutputExists(
                f"{out} already holds a training run: add --resume to continue it, or choose another --output"
            )
        if out.exists() and any(out.iterdir()):
            raise OutputExists(f"{out} is not empty and holds no training run: choose another --output")
        return False
    if not has_run:
        raise BadInput(f"nothing to resume in {out} (no {TRAIN_YAML}): drop --resume to start a new run")
    saved = (yaml.safe_load((out / TRAIN_YAML).read_text()) or {}).get("train", {})
    now = to_dict(cfg)
    run_facts = json.loads((out / RUN_JSON).read_text()) if (out / RUN_JSON).is_file() else {}
    saved.update(
        world_size=run_facts.get("world_size", world), micro_steps=run_facts.get("micro_steps", micro_steps)
    )
    now.update(world_size=world, micro_steps=micro_steps)
    diff = sorted(k for k in set(saved) | set(now) if k not in RESUME_IGNORED and saved.get(k) != now.get(k))
    if diff:
        detail = ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in diff)
        raise ResumeMismatch(f"cannot resume {out}: settings differ from its {TRAIN_YAML}: {detail}")
    return True


def write_run_files(cfg: TrainConfig, world: int, micro_steps: int, resumed: bool) -> None:
    """Write train.yaml (new runs only) and append this start to run.json (argv, versions)."""
    import transformers
    import yaml

    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    if not resumed:
        head = "# Resolved settings of this run (compared by --resume). Use it as a pipeline file: -c train.yaml\n"
        atomic_write_text(out / TRAIN_YAML, head + yaml.safe_dump({"train": to_dict(cfg)}, sort_keys=False))
    facts = json.loads((out / RUN_JSON).read_text()) if (out / RUN_JSON).is_file() else {"starts": []}
    from peagle_pipeline import __version__

    facts.update(world_size=world, micro_steps=micro_steps)
    facts["starts"].append(
        {
            "argv": sys.argv,
            "time": time.time(),
            "resumed": resumed,
            "versions": {
                "peagle_pipeline": __version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
        }
    )
    atomic_write_json(out / RUN_JSON, facts)
