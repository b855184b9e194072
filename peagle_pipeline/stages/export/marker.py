"""Where an export came from, read back: its marker (`.peagle-export.json`: the run, checkpoint, trained K and the
target's identity), and the checks built on it.

`same_run` compares a marker with a run's identity (`stages.run_records.run_identity`), `trained_depths` is
the K the draft was trained with, and `check_served_target` compares the recorded target with the one an export is
about to run on (`vllm-check`, `evaluate`). Reads only; the marker is written with the export (`stages.export.stage`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from peagle_pipeline.errors import BadInput

__all__ = [
    "MARKER_FILE",
    "read_marker",
    "export_run_dir",
    "trained_depths",
    "TARGET_IDENTITY",
    "target_identity",
    "check_served_target",
    "same_run",
]

MARKER_FILE = ".peagle-export.json"  # the run and checkpoint an export came from (ours; vLLM ignores it)


def read_marker(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What an export's marker records (`run_identity`, `checkpoint`, `step`, `time`); {} without a readable one."""
    try:
        facts = json.loads((Path(export_dir) / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def export_run_dir(export_dir: str | os.PathLike[str]) -> str | None:
    """The training run an export came from (its marker's "run"), or None (not ours, or no marker)."""
    run = read_marker(export_dir).get("run")
    return run if isinstance(run, str) else None


def trained_depths(export_dir: str | os.PathLike[str], config: dict[str, Any]) -> int:
    """K the draft of an export was trained with: its marker's `trained_depths`, else (an export of an older
    version or of another tool) the `speculative_tokens` of its `config`."""
    trained = read_marker(export_dir).get("trained_depths")
    if isinstance(trained, int) and trained > 0:
        return trained
    return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


# What identifies the target a draft was trained on (the cache's fields of the same names); the
# first two must match for a draft to serve a target, the chat template only shapes the data it was trained on.
TARGET_IDENTITY = ("target_config_sha256", "tokenizer_sha256", "chat_template_sha256")


def target_identity(model_path: str | os.PathLike[str]) -> dict[str, str]:
    """The identity of a target model directory: hashes of its config.json, tokenizer files and chat template,
    computed as the cache records them (`backends.pieces`)."""
    from peagle_pipeline import model_dir

    return {
        "target_config_sha256": model_dir.config_sha256(model_path),
        "tokenizer_sha256": model_dir.tokenizer_sha256(model_path),
        "chat_template_sha256": model_dir.chat_template_sha256(model_path),
    }


def check_served_target(
    export_dir: str | os.PathLike[str], target: str, allow_other: bool = False
) -> str | None:
    """Compare the target an export was trained on (its marker's "target") with the `target` it is about to run on.

    Returns:
        A one-line warning to print, or None: an export that records no identity (written before it was
        recorded), another chat template, or another model let through by `allow_other`.

    Raises:
        BadInput: the target's config.json or tokenizer differ from the trained-on ones (and not `allow_other`).
    """
    recorded = read_marker(export_dir).get("target")
    if not isinstance(recorded, dict):
        return (
            f"note: {export_dir} records no target identity (exported before it was recorded): not compared"
        )
    given = target_identity(target)
    differ = [k for k in TARGET_IDENTITY if recorded.get(k) is not None and recorded.get(k) != given[k]]
    model = [k.removesuffix("_sha256").replace("target_", "") for k in differ if k != "chat_template_sha256"]
    if model and not allow_other:
        raise BadInput(
            f"draft {export_dir} was trained on another target than {target} (its {' and '.join(model)} differ): "
            "give the target it was trained on, or --allow-other-target to run it anyway"
        )
    if model:
        return f"warning: draft {export_dir} was trained on another target ({' and '.join(model)} differ)"
    if differ:
        return (
            f"warning: {target}'s chat template differs from the one draft {export_dir} was trained with: "
            "acceptance may be lower"
        )
    return None


def same_run(marker: dict[str, Any], source: dict[str, Any] | None) -> bool:
    """Whether an export's marker names the run `source` (`run_identity`): by first start time, else by path."""
    if source is None:
        return False
    if marker.get("run_started") is not None or source.get("run_started") is not None:
        return marker.get("run_started") == source.get("run_started")
    return marker.get("run") == source.get("run")
