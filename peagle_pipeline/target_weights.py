"""The few tensors of a target model training needs, read straight from its safetensors files without loading
the model: the embedding, lm_head and final norm (`find_piece_names`, `load_target_pieces_from_model`) and, on
request, one decoder layer's tensors named the Llama way (`find_layer_names`). FP8 and integer-quantised weights
(AWQ, GPTQ, compressed-tensors) are made dense by `core/quantized_weights.py`. Never loads more than these tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from peagle_pipeline.cache.layout import LAYER_PIECE_PREFIX, PIECES_FILE
from peagle_pipeline.errors import BadInput
from peagle_pipeline.model_dir import model_folder, read_config, text_config

__all__ = [
    "find_piece_names",
    "load_target_pieces_from_model",
    "find_layer_names",
    "ATTENTION_TENSORS",
    "MLP_TENSORS",
]

# Prefixes under which decoder-only and multimodal checkpoints keep the language model's tensors.
_PREFIXES = (
    "model.",
    "",
    "model.language_model.",
    "language_model.model.",
    "language_model.",
    "transformer.",
    "gpt_neox.",
    "model.decoder.",
)
_EMBED_NAMES = (
    "embed_tokens.weight",
    "wte.weight",
    "embed_in.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
)
_NORM_NAMES = ("norm.weight", "ln_f.weight", "final_layer_norm.weight", "final_layernorm.weight")
_HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
    "model.lm_head.weight",
    "embed_out.weight",
    "output.weight",
)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (single file or sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise BadInput(f"cannot read safetensors index {index}: {err}") from None
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    files = [f for f in files if f.name != PIECES_FILE]
    if not files:
        raise BadInput(
            f"target model {model_dir} has no *.safetensors weights (convert .bin/GGUF checkpoints first)"
        )
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                names.update((k, f) for k in sf.keys())  # noqa: SIM118 - safe_open has no __iter__
        except Exception as err:  # safetensors raises its own error type for corrupt headers
            raise BadInput(f"cannot read safetensors file {f}: {str(err).splitlines()[0]}") from None
    return names


def _pick(names: dict[str, Path], candidates: tuple[str, ...], exclude_layers: bool = True) -> str | None:
    for prefix in _PREFIXES:
        for cand in candidates:
            if prefix + cand in names:
                return prefix + cand
    # Any other prefix (e.g. multimodal wrappers): the shortest name ending in a candidate as whole components.
    hits = [
        n
        for n in names
        for c in candidates
        if (n == c or n.endswith("." + c))
        and not (exclude_layers and (".layers." in n or ".h." in n))
        and "vision" not in n
        and "audio" not in n
    ]
    return min(hits, key=len) if hits else None


def find_piece_names(model_path: str | os.PathLike[str]) -> dict[str, str | None]:
    """Checkpoint tensor names of the pieces: {"embed_tokens.weight": ..., "lm_head.weight": ... or None (tied),
    "norm.weight": ...}.

    Raises:
        BadInput: the embedding or final norm is missing, or lm_head is missing in an untied model.
    """
    p = model_folder(model_path)
    config = read_config(p)
    names = _weight_files(p)
    embed = _pick(names, _EMBED_NAMES)
    norm = _pick(names, _NORM_NAMES)
    head = next((n for n in _HEAD_NAMES if _stored(names, n)), None)
    tied = bool(text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    if embed is None:
        raise BadInput(f"target model {p}: no embedding tensor (embed_tokens.weight) in its safetensors")
    if norm is None:
        raise BadInput(f"target model {p}: no final norm tensor (norm.weight) in its safetensors")
    if head is None and not tied:
        raise BadInput(f"target model {p}: no lm_head.weight and tie_word_embeddings is false")
    return {"embed_tokens.weight": embed, "lm_head.weight": None if tied else head, "norm.weight": norm}


def load_target_pieces_from_model(
    model_path: str | os.PathLike[str], init_layer: int | None = None
) -> dict[str, Any]:
    """The three piece tensors (torch, checkpoint dtype) read directly from the safetensors files, and the
    tensors of decoder layer `init_layer` when given and named the Llama way (see `find_layer_names`).

    Returns:
        {"embed_tokens.weight": [V, H], "lm_head.weight": [V, H] (the embedding when tied), "norm.weight": [H],
        and LAYER_PIECE_PREFIX + name for each of the layer's tensors}
    """
    p = model_folder(model_path)
    files = _weight_files(p)
    quant = read_config(p).get("quantization_config") or {}
    pieces: dict[str, Any] = {}
    for key, name in find_piece_names(p).items():
        source = name if name is not None else pieces["embed_tokens.weight"]
        try:
            pieces[key] = (
                _weight(files, source, quant) if isinstance(source, str) else source.clone()
            )  # tied: a copy
        except _UnreadableWeight as err:
            raise BadInput(f"target model {p}: {err}") from None
    if init_layer is not None:
        try:
            layer = {
                LAYER_PIECE_PREFIX + k: _weight(files, n, quant)
                for k, n in find_layer_names(files, init_layer).items()
            }
        except _UnreadableWeight:
            layer = {}  # no layer stored: train starts the draft at random and says so
        pieces.update(layer)
    return pieces


def _tensor(files: dict[str, Path], name: str) -> Any:
    from safetensors import safe_open

    with safe_open(str(files[name]), framework="pt") as sf:
        return sf.get_tensor(name).contiguous()


def _stored(files: dict[str, Path], name: str) -> bool:
    """Whether the checkpoint holds weight `name`, dense or in one of the integer forms that replace it (AWQ's and
    GPTQ's `qweight`, compressed-tensors' `weight_packed`)."""
    stem = name.removesuffix("weight")
    return name in files or (name.endswith("weight") and any(stem + q in files for q in _INTEGER_FORMS))


_INTEGER_FORMS = ("qweight", "weight_packed")


class _UnreadableWeight(Exception):
    """A weight stored in an integer form this package does not read (its layer is not stored: the draft starts
    at random)."""


def _weight(files: dict[str, Path], name: str, quant: dict[str, Any]) -> Any:
    """Weight `name` as a dense tensor: as stored, or dequantised (`core.quantized_weights`) when the checkpoint
    stores it in FP8 with its scale beside it or in an integer form in its place. `quant`: config.json's
    quantization_config ({} for none).

    Raises:
        BadInput: an FP8 tensor without either scale.
        _UnreadableWeight: an integer form of an unknown method or packing.
    """
    import torch

    from peagle_pipeline.core import quantized_weights as qw

    stem = name.removesuffix("weight")
    if name not in files:
        return _integer_weight(files, stem, quant)
    t = _tensor(files, name)
    if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t
    if stem + "weight_scale_inv" in files:
        return qw.fp8_weight(t, _tensor(files, stem + "weight_scale_inv"), quant.get("weight_block_size"))
    if stem + "weight_scale" in files:
        return qw.fp8_weight(t, _tensor(files, stem + "weight_scale"))
    raise BadInput(f"target tensor {name} is stored in {t.dtype} without a weight_scale to dequantise it by")


def _integer_weight(files: dict[str, Path], stem: str, quant: dict[str, Any]) -> Any:
    """The dense [O, I] weight of the linear `stem` stored as AWQ (GEMM), GPTQ or compressed-tensors'
    pack-quantized tensors (`core.quantized_weights`)."""
    from peagle_pipeline.core import quantized_weights as qw

    t = {k: _tensor(files, stem + k) for k in _INTEGER_TENSORS if stem + k in files}
    method = str(quant.get("quant_method", "")).lower()
    groups = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    widths = {g["num_bits"] for g in groups if "num_bits" in g}  # compressed-tensors names it per group
    bits = quant.get("bits") or quant.get("w_bit") or (widths.pop() if len(widths) == 1 else None)
    try:
        if {"qweight", "qzeros", "scales"} <= t.keys():
            if method == "awq" and str(quant.get("version", "gemm")).lower() == "gemm":
                return qw.awq_weight(t["qweight"], t["qzeros"], t["scales"], bits)
            if method == "gptq":
                offset = 0 if quant.get("checkpoint_format") == "gptq_v2" else 1
                return qw.gptq_weight(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), offset, bits)
        elif {"weight_packed", "weight_scale", "weight_shape"} <= t.keys():
            zero, shape = t.get("weight_zero_point"), t["weight_shape"].tolist()
            return qw.packed_weight(
                t["weight_packed"], t["weight_scale"], zero, shape, t.get("weight_g_idx"), bits
            )
    except ValueError as err:  # a packing other than 2, 4 or 8 bits
        raise _UnreadableWeight(f"{stem}weight: {err}") from None
    raise _UnreadableWeight(
        f"{stem}weight is stored quantised ({method or 'no quant_method'}) in a form not read here"
    )


# The tensors of a linear layer stored in an integer form: AWQ's and GPTQ's, then compressed-tensors'.
_INTEGER_TENSORS = (
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
)


# A Llama-style decoder layer's tensors (Llama, Mistral, Qwen2/3, SmolLM): what a draft's fused layer can start
# from. The attention and the norms are required; the MLP is taken where it is a Llama MLP (a mixture of experts,
# as in gpt-oss or Qwen3-MoE, is not); attention biases and Qwen3's per-head q/k norms where the checkpoint has them.
ATTENTION_TENSORS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
)
MLP_TENSORS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# The same layer with fused projections (Phi-3, Phi-4): q, k and v in one qkv_proj, gate and up in one gate_up_proj;
# stored as they are, split when read (`core.target_convention.split_fused_projections`).
FUSED_ATTENTION_TENSORS = (*ATTENTION_TENSORS[:2], "self_attn.qkv_proj.weight", "self_attn.o_proj.weight")
FUSED_MLP_TENSORS = ("mlp.gate_up_proj.weight", "mlp.down_proj.weight")
_LAYER_OPTIONAL = (
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)


def find_layer_names(files: dict[str, Path], layer: int) -> dict[str, str]:
    """{name: checkpoint name} of decoder layer `layer`'s ATTENTION_TENSORS, its MLP_TENSORS when it has all three,
    and its present biases and q/k norms; {} when the checkpoint lacks any of ATTENTION_TENSORS under one of the
    known prefixes, or the layer has other norms than Llama's (`_has_other_norms`): another architecture, no copy."""
    for prefix in _PREFIXES:
        base = f"{prefix}layers.{layer}."
        if _has_other_norms(files, base):
            return {}
        for attention, mlp in (
            (ATTENTION_TENSORS, MLP_TENSORS),
            (FUSED_ATTENTION_TENSORS, FUSED_MLP_TENSORS),
        ):
            if all(_stored(files, base + t) for t in attention):
                found = (
                    *attention,
                    *(mlp if all(_stored(files, base + t) for t in mlp) else ()),
                    *_LAYER_OPTIONAL,
                )
                return {t: base + t for t in found if _stored(files, base + t)}
    return {}


# The norms of a Llama-style layer (Qwen3's per-head q/k norms included), all RMS norms without a bias.
_LLAMA_NORMS = frozenset(
    {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    }
)


def _has_other_norms(files: dict[str, Path], base: str) -> bool:
    """Whether the layer under `base` has a norm a Llama layer does not: norms after the attention and the MLP as well
    as before them (Gemma's `pre_feedforward_layernorm`, GLM-4's `post_self_attn_layernorm`), or LayerNorms with a
    bias (StableLM, StarCoder2, Phi-MoE, Nemotron)."""
    for name in files:
        if name.startswith(base):
            own = name[len(base) :]
            if own.endswith("norm.bias") or (own.endswith("norm.weight") and own not in _LLAMA_NORMS):
                return True
    return False
