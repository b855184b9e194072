"""Hand-made exports for the vLLM tier: a random P-EAGLE (or EAGLE-3) draft for a target, written by our own exporter.

The weights are random (acceptance ~ 0), but the files are exactly what `peagle-pipeline train` exports
(`stages.export.write_export` of a `core.model.PEagleDraft`, or of a `core.eagle3.Eagle3Draft` for
`method="eagle3"`), so vLLM must load them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["make_random_draft"]


def make_random_draft(
    target: str | Path,
    out: str | Path,
    layer_ids: list[int],
    depths: int = 3,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    draft_layers: int = 1,
    rope_parameters: dict | None = None,
    method: str = "peagle",
    qk_norm: bool | None = None,
) -> Path:
    """Export a random P-EAGLE draft of `draft_layers` layers for `target` (embeddings/lm_head/norm from the target) to `out`.

    Args:
        target: HF model directory of the target.
        out: export directory to write.
        layer_ids: aux layer ids (vLLM convention).
        depths: K, the number of tokens drafted in parallel.
        draft_vocab_size: Vd (default: the full target vocabulary); the Vd smallest-id tokens when smaller.
        rope_parameters: the draft's RoPE instead of the target's (a rotation no runnable target of the tier
            has, checked on a target that runs).
        method: "peagle" or "eagle3" (the speculators format written, as `train --method`).
        qk_norm: Qwen3-style draft layers (`train --draft-arch qwen3`) or not; default: the target's family.
    """
    from peagle_pipeline.core.draft_config import DraftConfig, has_qk_norm
    from peagle_pipeline.core.eagle3 import Eagle3Draft
    from peagle_pipeline.core.model import PEagleDraft
    from peagle_pipeline.core.vocab import build_draft_vocab
    from peagle_pipeline.model_dir import read_target_info
    from peagle_pipeline.stages.draft_spec import DraftSpec
    from peagle_pipeline.stages.export.marker import target_identity
    from peagle_pipeline.stages.export.stage import write_export
    from peagle_pipeline.target_weights import load_target_pieces_from_model

    info = read_target_info(target)
    config = info.config if rope_parameters is None else {**info.config, "rope_parameters": rope_parameters}
    V = info.vocab_size
    Vd = draft_vocab_size or V
    mask_token_id = V - 1  # an id vLLM accepts; the tiny tokenizer leaves the last rows unused
    spec = DraftSpec(
        target_config=config,
        verifier_name_or_path=str(target),
        verifier_architectures=list(info.architectures),
        aux_layer_ids=sorted(layer_ids),
        draft_layers=draft_layers,
        draft_vocab_size=Vd,
        mask_token_id=mask_token_id,
        norm_before_residual=False,
        depths=depths,
        # a Qwen3 target gets a Qwen3 draft layer, as `train` makes it by default (`--draft-arch auto`)
        qk_norm=has_qk_norm(info.config) if qk_norm is None else qk_norm,
        target_identity=target_identity(target),
        method=method,
    )
    cfg = DraftConfig.from_target_config(
        config,
        num_layers=draft_layers,
        num_aux=len(layer_ids),
        draft_vocab_size=Vd,
        mask_token_id=mask_token_id,
        qk_norm=spec.qk_norm,
    )
    counts = torch.arange(V, 0, -1, dtype=torch.float64)  # lower ids "more frequent": Vd smallest ids kept
    vocab = build_draft_vocab(counts, Vd) if Vd < V else None
    pieces = {k: v for k, v in load_target_pieces_from_model(target).items()}
    model_class = Eagle3Draft if method == "eagle3" else PEagleDraft
    model = model_class(cfg, pieces, vocab, generator=torch.Generator().manual_seed(seed))
    path = write_export(out, spec, model.state_dict())
    json.loads((path / "config.json").read_text())  # written and parseable
    return path
