"""The exports `evaluate` measures: where each is, its method (P-EAGLE or EAGLE-3, from its config.json), the K it
serves and was trained for, the K list it is measured at (`DIR@K` on the command line), and what its training run
estimated (the held-out AL from the run's metrics.jsonl, at the exported checkpoint's step), for the report.

Reads export folders and run folders only; never runs vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from peagle_pipeline.config.evaluate import K_LIST, parse_depths
from peagle_pipeline.errors import BadInput
from peagle_pipeline.stages.evaluate.acceptance import draft_depths, draft_method, read_draft_config
from peagle_pipeline.stages.run_layout import EXPORT_DIR

__all__ = [
    "Draft",
    "split_draft_arg",
    "expand_depths",
    "find_run",
    "exported_step",
    "trainer_estimate",
    "estimate_of_export",
    "walk_of_export",
    "resolve_draft",
]


@dataclass
class Draft:
    """One export to measure: where it is, its K, and what its training run estimated."""

    name: str
    path: str
    verifier: str | None
    vocab_size: int | None
    trained_depths: int
    depths: int
    run: str | None
    estimate: dict[str, Any] | None
    method: str = "peagle"
    """"peagle" (parallel drafting) or "eagle3" (sequential drafting), the export's `speculators_model_type`."""
    group: str = ""
    """The export's name, shared by its measurements at several K (`name` is then `group@K`); "" = `name`."""

    @property
    def label(self) -> str:
        """The name of the export itself, whatever K it is measured at (one line per label in the chart)."""
        return self.group or self.name

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "path": self.path,
            "method": self.method,
            "parallel_drafting": self.method == "peagle",
            "trained_depths": self.trained_depths,
            "depths": self.depths,
            "run": self.run,
            "trainer_estimate": self.estimate,
        }


def find_run(export_dir: str | Path) -> Path | None:
    """The training run an export came from: named by its `.peagle-export.json` (`run` or `run_dir`, relative to
    the export), else the export's parent when the export sits in a run (`train` writes RUN/export); else None."""
    from peagle_pipeline.stages.export.marker import read_marker
    from peagle_pipeline.stages.run_layout import TRAIN_YAML

    export = Path(export_dir)
    facts = read_marker(export)
    named = facts.get("run") or facts.get("run_dir")
    if isinstance(named, str):
        run = Path(named) if Path(named).is_absolute() else export / named
        if (run / TRAIN_YAML).is_file():
            return run
    parent = export.resolve().parent
    return parent if (parent / TRAIN_YAML).is_file() else None


def exported_step(export_dir: str | Path, run_dir: Path) -> int | None:
    """The training step of the checkpoint an export holds (its marker's `step`), or None: unknown, or the marker
    names another run than `run_dir` (an export found beside a run it does not come from)."""
    from peagle_pipeline.stages.export.marker import read_marker, same_run
    from peagle_pipeline.stages.run_records import run_identity

    facts = read_marker(export_dir)
    step = facts.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not same_run(facts, run_identity(run_dir)):
        return None
    return step


def trainer_estimate(run_dir: Path, step: int | None = None) -> dict[str, Any] | None:
    """The trainer's held-out acceptance estimates: the last one, the best one (what `export` takes by default) and,
    given the exported checkpoint's `step`, the one of that step (`exported_acceptance_length`, None when the run
    did not evaluate at that step). Beside each anchor mean, `*_walk` is the same evaluation's acceptance walked as
    vLLM walks a reply (`core.loss.acceptance_walk`; None for runs made before it was recorded)."""
    from peagle_pipeline.stages.evaluate.prompts import read_train_settings
    from peagle_pipeline.stages.run_records import read_metrics

    evals = [
        r
        for r in read_metrics(run_dir)
        if r.get("kind") == "eval" and isinstance(r.get("acceptance"), int | float)
    ]
    if not evals:
        return None
    best = max(evals, key=lambda r: r["acceptance"])
    try:
        depths: int | None = int(read_train_settings(run_dir)["depths"])
    except (BadInput, KeyError, TypeError, ValueError):
        depths = None
    at_step = [r for r in evals if step is not None and r.get("step") == step]
    return {
        "acceptance_length": evals[-1]["acceptance"],
        "acceptance_walk": _walk(evals[-1]),
        "step": evals[-1]["step"],
        "exported_acceptance_length": at_step[-1]["acceptance"] if at_step else None,
        "exported_acceptance_walk": _walk(at_step[-1]) if at_step else None,
        "exported_step": step,
        "best_acceptance_length": best["acceptance"],
        "best_step": best["step"],
        "depths": depths,
        "run": str(run_dir),
    }


def _walk(record: dict[str, Any]) -> float | None:
    walk = record.get("acceptance_walk")
    return float(walk) if isinstance(walk, int | float) and not isinstance(walk, bool) else None


def estimate_of_export(estimate: dict[str, Any] | None) -> float | None:
    """The estimate that belongs beside vLLM's AL: that of the exported checkpoint's step, else the run's last."""
    if estimate is None:
        return None
    exported = estimate.get("exported_acceptance_length")
    return exported if exported is not None else estimate["acceptance_length"]


def walk_of_export(estimate: dict[str, Any] | None) -> float | None:
    """The walk of the evaluation `estimate_of_export` takes (None where that evaluation recorded none)."""
    if estimate is None:
        return None
    if estimate.get("exported_acceptance_length") is not None:
        return estimate.get("exported_acceptance_walk")
    return estimate.get("acceptance_walk")


def split_draft_arg(arg: str) -> tuple[str, list[int] | None]:
    """A draft argument `DIR` or `DIR@KLIST` (`config.evaluate.parse_depths`): the directory and its own K list (None: not given).

    An existing directory whose name itself ends in "@..." is taken as it is.
    """
    path, at, ks = arg.rpartition("@")
    if not at or not path or not K_LIST.match(ks) or Path(arg).is_dir():
        return arg, None
    return path, parse_depths(ks)


def expand_depths(draft: Draft, depths: list[int]) -> list[Draft]:
    """One measurement per K of `depths` (an engine each): named `NAME@K` when there are several."""
    if len(depths) == 1:
        return [replace(draft, depths=depths[0], group=draft.name)]
    return [replace(draft, depths=k, name=f"{draft.name}@{k}", group=draft.name) for k in depths]


def resolve_draft(path: str, depths: int | None) -> Draft:
    """Check an export and gather what the report says about it.

    Raises:
        BadInput: missing directory or not a P-EAGLE or EAGLE-3 export.
    """
    from peagle_pipeline.stages.export.marker import trained_depths

    config = read_draft_config(path)
    served, trained = draft_depths(config), trained_depths(path, config)
    verifier = (config.get("speculators_config", {}).get("verifier") or {}).get("name_or_path")
    vocab = (config.get("transformer_layer_config") or {}).get("vocab_size")
    run_dir = find_run(path)
    p = Path(path)
    name = f"{p.resolve().parent.name}/{p.name}" if p.name == EXPORT_DIR else p.name
    return Draft(
        name=name,
        path=str(path),
        verifier=verifier if isinstance(verifier, str) else None,
        vocab_size=int(vocab) if isinstance(vocab, int) else None,
        trained_depths=trained,
        depths=depths if depths is not None else served,
        run=str(run_dir) if run_dir is not None else None,
        estimate=trainer_estimate(run_dir, exported_step(path, run_dir)) if run_dir is not None else None,
        method=draft_method(config),
    )
