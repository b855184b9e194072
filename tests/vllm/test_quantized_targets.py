"""Integer-quantised targets (Qwen3-*-AWQ, GPTQ checkpoints, llm-compressor's W4A16 / W8A16): the layer a draft
starts from is read as the weights the upstream packers' own dequantisation gives, exactly.

The checkpoints are packed by the upstream code, not by ours: vLLM's `quantize_weights`, `awq_pack` and `gptq_pack`
(the layouts its AWQ and GPTQ kernels read) and the compressed-tensors package's pack-quantized compressor, whose
`decompress` is the reference for its form. Before core/quantized_weights.py such a layer was not stored at all and
the draft started from random weights. No engine starts here; the vLLM tier is where these packages are installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_pipeline.cache.layout import LAYER_PIECE_PREFIX
from peagle_pipeline.target_weights import load_target_pieces_from_model

LAYER = 3  # the tiny Qwen3's last layer
GROUP = 16


def _vllm_packed(w: torch.Tensor, form: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """{suffix: tensor} of weight `w` [O, I] (fp16) as an AWQ or GPTQ checkpoint stores it, and the dense weight
    vLLM's quantiser dequantises it to ([O, I])."""
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu
    from vllm.scalar_type import scalar_types

    out, inputs = w.shape
    if form == "awq":  # 4 bits, zero points, GEMM layout
        ref, q, s, z = qu.quantize_weights(w.t().contiguous(), scalar_types.uint4, GROUP, zero_points=True)
        packed = {
            "qweight": qu.awq_pack(q, 4, inputs, out),
            "qzeros": qu.awq_pack(z, 4, inputs // GROUP, out),
        }
        return {**packed, "scales": s}, ref.t()
    if (
        form == "gptq"
    ):  # 4 bits, symmetric, rows quantised out of order (desc_act): g_idx; zeros stored minus one
        order = torch.randperm(inputs, generator=torch.Generator().manual_seed(out))
        back = torch.argsort(order)
        ref, q, s, _ = qu.quantize_weights(w.t()[order].contiguous(), scalar_types.uint4b8, GROUP)
        g_idx = torch.empty(inputs, dtype=torch.int32)
        g_idx[order] = (torch.arange(inputs) // GROUP).int()
        zeros = qu.pack_cols(
            torch.full((inputs // GROUP, out), 7, dtype=torch.int32), 4, inputs // GROUP, out
        )
        return {
            "qweight": qu.gptq_pack(q[back], 4, inputs, out),
            "qzeros": zeros,
            "scales": s,
            "g_idx": g_idx,
        }, ref[back].t()
    # "gptq_v2": 8 bits, asymmetric, zeros stored as they are
    ref, q, s, z = qu.quantize_weights(w.t().contiguous(), scalar_types.uint8, GROUP, zero_points=True)
    packed = {"qweight": qu.gptq_pack(q, 8, inputs, out), "qzeros": qu.pack_cols(z, 8, inputs // GROUP, out)}
    return {**packed, "scales": s}, ref.t()


def _compressed(w: torch.Tensor, symmetric: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """{suffix: tensor} of `w` [O, I] (bf16) packed by compressed-tensors (4 bits, groups of GROUP), and the weight
    its decompress gives."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    groups = w.float().unflatten(1, (-1, GROUP))
    state = {"weight": w}
    if symmetric:
        state["weight_scale"] = (groups.abs().amax(-1) / 7.5).bfloat16()
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = (high - low) / 15
        state |= {
            "weight_scale": scale.bfloat16(),
            "weight_zero_point": (torch.round(-low / scale) - 8).to(torch.int8),
        }
    packed = PackedQuantizationCompressor.compress(state, scheme)
    return packed, PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]


QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True},
    "gptq_v2": {
        "quant_method": "gptq",
        "bits": 8,
        "group_size": GROUP,
        "sym": False,
        "checkpoint_format": "gptq_v2",
    },
}


def _compressed_config(symmetric: bool) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP}
    group = {"targets": ["Linear"], "weights": weights}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
    }


def _quantised_copy(tiny_qwen3: Path, dest: Path, form: str) -> dict[str, torch.Tensor]:
    """The tiny Qwen3 with layer LAYER's seven projections stored in `form`; {projection name: reference weight}."""
    model = shutil.copytree(tiny_qwen3, dest)
    weights = load_file(str(model / "model.safetensors"))
    base = f"model.layers.{LAYER}."
    expected = {}
    for name in [n for n in weights if n.startswith(base) and n.endswith("proj.weight")]:
        w = weights.pop(name)
        if form.startswith("compressed"):
            packed, expected[name] = _compressed(w.bfloat16(), symmetric=form == "compressed-sym")
        else:
            packed, expected[name] = _vllm_packed(w.half(), form)
        weights |= {name.removesuffix("weight") + k: v.contiguous() for k, v in packed.items()}
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = (
        _compressed_config(form == "compressed-sym") if form.startswith("compressed") else QUANT_CONFIGS[form]
    )
    (model / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("form", ["awq", "gptq", "gptq_v2", "compressed-sym", "compressed-asym"])
def test_a_quantised_targets_layer_is_the_upstream_dequantised_one(tiny_qwen3, tmp_path, form):
    expected = _quantised_copy(tiny_qwen3, tmp_path / "model", form)
    assert len(expected) == 7
    pieces = load_target_pieces_from_model(tmp_path / "model", init_layer=LAYER)
    for name, want in expected.items():
        got = pieces[LAYER_PIECE_PREFIX + name.split(f"layers.{LAYER}.")[1]]
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert LAYER_PIECE_PREFIX + "self_attn.q_norm.weight" in pieces  # the rest of the layer, as before


def test_an_unread_integer_layout_stores_no_layer(tiny_qwen3, tmp_path):
    """AWQ's GEMV layout is not read: no layer is stored (the draft starts at random and train says so), and the
    embedding, lm_head and final norm are read as before."""
    _quantised_copy(tiny_qwen3, tmp_path / "model", "awq")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    pieces = load_target_pieces_from_model(tmp_path / "model", init_layer=LAYER)
    assert not [k for k in pieces if k.startswith(LAYER_PIECE_PREFIX)]
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= pieces.keys()
