"""What defines a trained draft besides its weights (`DraftSpec`), saved as RUN/draft.json.

The trainer writes it at the start of a run (`stages.train.draft`); the export reads it back to write the
speculators config (`stages.export.speculators_format`). Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle_pipeline.errors import BadInput, CorruptCache
from peagle_pipeline.model_dir import text_config
from peagle_pipeline.runtime import atomic_write_json

__all__ = ["DRAFT_SPEC", "DraftSpec", "EXPORT_METHODS", "export_method"]

DRAFT_SPEC = "draft.json"
# The drafting methods an export can hold, each under its speculators_model_type (the same name): P-EAGLE's
# `peagle` (vLLM drafts all K tokens in one pass, `parallel_drafting`) and `eagle3` (K sequential steps).
EXPORT_METHODS = ("peagle", "eagle3")


def export_method(config: Any) -> str | None:
    """The drafting method of an export's config.json (a dict), None when it is not one of ours."""
    found = config.get("speculators_model_type") if isinstance(config, dict) else None
    return found if found in EXPORT_METHODS else None


@dataclass(frozen=True, kw_only=True)
class DraftSpec:
    """Everything (besides weights) that defines a trained draft; saved as RUN/draft.json."""

    target_config: dict[str, Any]
    verifier_name_or_path: str
    verifier_architectures: list[str]
    aux_layer_ids: list[int]
    draft_layers: int
    draft_vocab_size: int
    mask_token_id: int
    norm_before_residual: bool
    depths: int
    # Qwen3 draft layers (QK-norm, `core.model.has_qk_norm` of the target); False in runs started before them.
    qk_norm: bool = False
    # The target the draft was trained on, from the cache (`target_identity`); None in runs started before it
    # was recorded. The export's marker carries it, and vllm-check / evaluate compare it with the target given.
    target_identity: dict[str, str] | None = None
    # The drafting method (`train.method`): "peagle" (the speculators peagle format; runs started before methods
    # were named) or "eagle3" (the eagle3 format: no mask token, no mask_hidden).
    method: str = "peagle"

    @property
    def text_config(self) -> dict[str, Any]:
        """The target's language-model config (`text_config` of a multimodal checkpoint such as Qwen3.5)."""
        return text_config(self.target_config)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    def save(self, run_dir: str | os.PathLike[str]) -> None:
        atomic_write_json(Path(run_dir) / DRAFT_SPEC, dataclasses.asdict(self))

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> DraftSpec:
        """Raises BadInput (no draft.json: not a run) or CorruptCache (a draft.json that cannot be read)."""
        path = Path(run_dir) / DRAFT_SPEC
        if not path.is_file():
            raise BadInput(f"{run_dir} is not a training run (no {DRAFT_SPEC})")
        try:
            spec = cls(**json.loads(path.read_text()))
            spec.vocab_size, spec.hidden_size  # noqa: B018 (the target facts must be there too)
        except (ValueError, TypeError, KeyError) as err:
            raise CorruptCache(
                f"{path} is damaged ({type(err).__name__}); `train --resume` on this run writes it again"
            ) from None
        return spec
