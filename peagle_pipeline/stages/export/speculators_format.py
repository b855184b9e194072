"""The speculators formats vLLM loads, `peagle` (P-EAGLE) and `eagle3` (EAGLE-3; the same fields and weights but
`mask_token_id` and `mask_hidden`): the `config.json` of a draft, its weights in export form, and a draft rebuilt
from an export folder.

`export_config` writes every field vLLM's P-EAGLE loader reads; `serving_depths` is the K it serves; `export_weights` gives
bf16 floats, plus `d2t` (int64) and `t2d` (bool) only when the draft vocabulary is smaller than the target's;
`load_export` reads such a folder back into a `PEagleDraft` for checks and evaluation. No files are written here
(`stages.export.stage` writes them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from peagle_pipeline.core.settings import SERVING_DEPTHS
from peagle_pipeline.errors import BadInput, NumericalFault
from peagle_pipeline.stages.draft_spec import EXPORT_METHODS, DraftSpec, export_method

if TYPE_CHECKING:
    from peagle_pipeline.core.model import PEagleDraft

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "serving_depths",
    "export_config",
    "export_weights",
    "load_export",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def serving_depths(trained: int, requested: int | None = None) -> int:
    """The K an export records as `speculative_tokens` (what vLLM drafts unless its speculative_config says
    otherwise): `requested`, else `SERVING_DEPTHS`, never more than the `trained` depths.

    Raises:
        BadInput: `requested` is not positive or exceeds the depths the draft was trained for.
    """
    if requested is None:
        return min(SERVING_DEPTHS, trained)
    if requested < 1:
        raise BadInput(f"--speculative-tokens must be positive, got {requested}")
    if requested > trained:
        raise BadInput(
            f"--speculative-tokens {requested} exceeds the {trained} depths the draft was trained for: "
            f"give at most {trained}, or train with --depths {requested} or more"
        )
    return requested


def export_config(spec: DraftSpec, speculative_tokens: int | None = None) -> dict[str, Any]:
    """The speculators `config.json` of a draft (every field vLLM's P-EAGLE loader reads); `speculative_tokens` is the
    served K (`serving_depths`), `spec.depths` the trained one."""
    from peagle_pipeline.core.draft_config import DraftConfig

    draft = DraftConfig.from_target_config(
        spec.target_config,
        num_layers=spec.draft_layers,
        num_aux=len(spec.aux_layer_ids),
        draft_vocab_size=spec.draft_vocab_size,
        mask_token_id=spec.mask_token_id,
        norm_before_residual=spec.norm_before_residual,
        qk_norm=spec.qk_norm,
    )
    layer = (
        draft.layer_config()
    )  # sizes, heads, head_dim, RoPE, num_aux_hidden_states (vLLM assumes 3 without)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = spec.text_config.get(key, spec.target_config.get(key))
        if value is not None:
            layer[key] = value
    layer["dtype"] = "bfloat16"  # (transformers >= 4.56's name: "torch_dtype" prints a deprecation warning)
    config = {
        "speculators_model_type": spec.method,  # no top-level model_type: vLLM detects speculators_config
        "speculators_config": {
            "algorithm": spec.method,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": serving_depths(spec.depths, speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": spec.verifier_name_or_path,
                "architectures": list(spec.verifier_architectures),
            },
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.draft_vocab_size,
        "mask_token_id": spec.mask_token_id,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "norm_before_residual": spec.norm_before_residual,
        "norm_before_fc": False,
        "target_hidden_size": spec.hidden_size,
        "dtype": "bfloat16",
    }
    if spec.method == "eagle3":  # drafted tokens only: no mask token (vLLM's eagle3 loader reads none)
        del config["mask_token_id"]
    return config


def export_weights(spec: DraftSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draft state dict in export form: floats to bf16; d2t int64 / t2d bool only when Vd < V."""
    out: dict[str, torch.Tensor] = {}
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise NumericalFault(
            f"the draft's {', '.join(sorted(bad)[:3])} hold non-finite values: not exported (the run diverged; "
            "export an earlier checkpoint with --checkpoint step-N, or retrain with a lower lr)"
        )
    for key, value in state.items():
        if key in ("d2t", "t2d"):
            continue
        value = value.detach().to("cpu")
        out[key] = (value.to(torch.bfloat16) if value.is_floating_point() else value).contiguous()
    if spec.draft_vocab_size < spec.vocab_size:
        for key, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
            if key not in state:
                raise BadInput(
                    f"draft with vocabulary {spec.draft_vocab_size} < {spec.vocab_size} lacks {key}"
                )
            out[key] = state[key].detach().to("cpu", dtype).contiguous()
    return out


def load_export(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> PEagleDraft:
    """Rebuild the draft of an export directory (weights in `dtype`), for checks and evaluation: a `PEagleDraft`,
    or an `Eagle3Draft` (a subclass) for an eagle3 export.

    Raises:
        BadInput: not an export of ours.
    """
    from peagle_pipeline.core.draft_config import DraftConfig
    from peagle_pipeline.core.eagle3 import Eagle3Draft
    from peagle_pipeline.core.model import PEagleDraft
    from peagle_pipeline.core.vocab import DraftVocab

    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        weights = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError) as err:
        raise BadInput(f"{path} is not a draft export ({type(err).__name__})") from None
    method = export_method(config)
    if method is None:
        raise BadInput(
            f"{path} is not a draft export (speculators_model_type is not one of {', '.join(EXPORT_METHODS)})"
        )
    layer = config["transformer_layer_config"]
    cfg = DraftConfig.from_target_config(
        layer,
        num_layers=int(layer["num_hidden_layers"]),
        num_aux=int(layer["num_aux_hidden_states"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
        mask_token_id=int(config.get("mask_token_id", 0)),  # eagle3: none (nothing reads it)
        norm_before_residual=bool(config["norm_before_residual"]),
        qk_norm=layer.get("model_type") == "qwen3",
    )
    dvocab = None
    if "d2t" in weights and "t2d" in weights:  # Vd < V: rebuild the mapping from the exported offsets
        d2t, t2d = weights["d2t"].long(), weights["t2d"].bool()
        ids = torch.arange(d2t.numel()) + d2t
        to_draft = torch.full((t2d.numel(),), -1, dtype=torch.long)
        to_draft[ids] = torch.arange(d2t.numel())
        dvocab = DraftVocab(ids=ids, d2t=d2t, t2d=t2d, target_to_draft=to_draft)
    model = (Eagle3Draft if method == "eagle3" else PEagleDraft)(cfg, None, dvocab)
    current = model.state_dict()
    full = {}
    for key, ref in current.items():
        if key in weights:
            full[key] = weights[key].to(ref.dtype if not ref.is_floating_point() else dtype)
        elif key in ("d2t", "t2d"):  # Vd == V: identity mapping, not stored
            full[key] = ref
        else:
            raise BadInput(f"{path}/{WEIGHTS_FILE} lacks {key}")
    extra = set(weights) - set(current)
    if extra:
        raise BadInput(f"{path}/{WEIGHTS_FILE} has unexpected tensors {sorted(extra)[:5]}")
    model.to(dtype)
    model.load_state_dict(full, strict=True)
    return model.eval()
