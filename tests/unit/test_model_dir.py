"""backends.pieces: target info from config.json, hashes, and the pieces read straight from safetensors (written
by cache.target into a cache's target/)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_pipeline.cache.target import save_target_pieces
from peagle_pipeline.errors import BadInput
from peagle_pipeline.model_dir import (
    chat_template_sha256,
    config_sha256,
    read_target_info,
    tokenizer_sha256,
)
from peagle_pipeline.stages.extract.cache_output import target_source


def _save(model, out):
    """A cache's target/ from a model directory, as `extract` writes it."""
    return save_target_pieces(out, target_source(model))


def test_target_info_and_hashes(tiny_model, tmp_path):
    info = read_target_info(tiny_model)
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (6, 64, 512)
    assert info.architectures == ["LlamaForCausalLM"] and info.config["hidden_size"] == 64
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    assert config_sha256(copy) == config_sha256(tiny_model)
    assert tokenizer_sha256(copy) == tokenizer_sha256(tiny_model)
    assert chat_template_sha256(copy) == chat_template_sha256(tiny_model)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))  # formatting only: same hash
    assert config_sha256(copy) == config_sha256(tiny_model)
    cfg["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert config_sha256(copy) != config_sha256(tiny_model)
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    assert chat_template_sha256(copy) != chat_template_sha256(tiny_model)


def test_nested_text_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Gemma3ForConditionalGeneration"],
                "text_config": {"num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 100},
                "vision_config": {},
            }
        )
    )
    info = read_target_info(tmp_path)
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (4, 32, 100)


def test_pieces_equal_model_weights(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    out = _save(tiny_model, tmp_path / "target")
    pieces = load_file(str(out / "pieces.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.bfloat16)
    assert torch.equal(pieces["embed_tokens.weight"], model.model.embed_tokens.weight)
    assert torch.equal(pieces["lm_head.weight"], model.lm_head.weight)
    assert torch.equal(pieces["norm.weight"], model.model.norm.weight)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tiny_model / name).read_bytes()
    assert not list(out.glob("*.tmp"))


def test_sharded_tied_checkpoint_with_layer_norms(tmp_path):
    g = torch.Generator().manual_seed(0)
    embed, norm = torch.randn(10, 4, generator=g), torch.randn(4, generator=g)
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 1, "hidden_size": 4, "vocab_size": 10, "tie_word_embeddings": True})
    )
    save_file(
        {"model.embed_tokens.weight": embed, "model.layers.0.input_layernorm.weight": torch.ones(4)},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"model.norm.weight": norm, "model.layers.0.post_attention_layernorm.weight": torch.zeros(4)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "model.layers.0.input_layernorm.weight": "model-00001-of-00002.safetensors",
                    "model.norm.weight": "model-00002-of-00002.safetensors",
                    "model.layers.0.post_attention_layernorm.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    pieces = load_file(str(_save(tmp_path, tmp_path / "out") / "pieces.safetensors"))
    assert torch.equal(pieces["embed_tokens.weight"], embed) and torch.equal(pieces["lm_head.weight"], embed)
    assert torch.equal(pieces["norm.weight"], norm)


def test_bad_model_paths(tmp_path):
    with pytest.raises(BadInput, match="not found"):
        read_target_info(tmp_path / "nope")
    with pytest.raises(BadInput, match="no config.json"):
        _save(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BadInput, match="cannot read"):
        read_target_info(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 1, "hidden_size": 4, "vocab_size": 10})
    )
    with pytest.raises(BadInput, match="no \\*.safetensors"):
        _save(tmp_path, tmp_path / "out")
    save_file(
        {"model.embed_tokens.weight": torch.zeros(10, 4), "model.norm.weight": torch.ones(4)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(BadInput, match="no lm_head"):
        _save(tmp_path, tmp_path / "out")


def test_pieces_with_the_target_layer_are_the_same_bytes_every_time(tiny_model, tmp_path):
    """The stored layer's index is a tensor, not a second metadata key: safetensors writes metadata keys in an order
    that varies between writes, and a cache's files must be byte-identical however often they are written."""
    from peagle_pipeline.cache import layout

    blobs = set()
    for i in range(8):
        out = save_target_pieces(tmp_path / str(i), target_source(tiny_model, init_layer=5))
        blobs.add((out / layout.PIECES_FILE).read_bytes())
    assert len(blobs) == 1
    pieces = load_file(str(tmp_path / "0" / layout.PIECES_FILE))
    assert pieces[layout.LAYER_INDEX_KEY].tolist() == [5]
    weights = load_file(str(tiny_model / "model.safetensors"))
    assert torch.equal(pieces["init_layer.mlp.up_proj.weight"], weights["model.layers.5.mlp.up_proj.weight"])


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w / scale in float8_e4m3fn, as an FP8 checkpoint stores it."""
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("kind", ["blocks", "rows"])
def test_an_fp8_checkpoints_layer_is_read_dequantised(tiny_model, tmp_path, kind):
    """Qwen3's and DeepSeek's FP8 checkpoints (blocks of 16 x 16 here, `weight_scale_inv`, the block size in
    quantization_config) and compressed-tensors' (a scale per row, `weight_scale`): the layer the draft starts from
    is read as the weights times their scales, within FP8's rounding (it was read as the raw FP8 values, up to 448).
    An FP8 tensor without a scale is refused in one line."""
    from peagle_pipeline.cache.layout import LAYER_PIECE_PREFIX
    from peagle_pipeline.target_weights import load_target_pieces_from_model

    model = shutil.copytree(tiny_model, tmp_path / "model")
    weights = load_file(str(model / "model.safetensors"))
    layer = "model.layers.5."
    projections = [n for n in weights if n.startswith(layer) and n.endswith("proj.weight")]
    assert len(projections) == 7
    for name in projections:
        w = weights[name].float()
        if kind == "blocks":  # one scale per 16 x 16 block: its largest magnitude / 448
            blocks = w.unflatten(0, (-1, 16)).unflatten(2, (-1, 16)).abs().amax((1, 3)) / 448
            weights[name.removesuffix("weight") + "weight_scale_inv"] = blocks
            full = blocks.repeat_interleave(16, 0).repeat_interleave(16, 1)
        else:
            full = w.abs().amax(1, keepdim=True) / 448
            weights[name.removesuffix("weight") + "weight_scale"] = full
        weights[name] = _fp8(w, full)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    if kind == "blocks":
        config = json.loads((model / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
        (model / "config.json").write_text(json.dumps(config))
    original = load_file(str(tiny_model / "model.safetensors"))
    pieces = load_target_pieces_from_model(model, init_layer=5)
    for name in projections:
        got = pieces[LAYER_PIECE_PREFIX + name.removeprefix(layer)]
        assert got.dtype == torch.bfloat16 and got.shape == original[name].shape
        torch.testing.assert_close(got.float(), original[name].float(), rtol=0.07, atol=2e-3)
    del weights[
        projections[0].removesuffix("weight") + ("weight_scale_inv" if kind == "blocks" else "weight_scale")
    ]
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInput, match="is stored in torch.float8_e4m3fn without a weight_scale"):
        load_target_pieces_from_model(model, init_layer=5)


@pytest.mark.parametrize("model_type", ["glm4", "stablelm"])
def test_a_layer_with_other_norms_than_llamas_is_not_stored(tmp_path, model_type):
    """GLM-4 normalises its attention's and MLP's outputs as well (`post_self_attn_layernorm`), StableLM's norms are
    LayerNorms with a bias: neither layer is a Llama one, so none is stored to start the draft from (both were
    stored, and the draft started near the layer, not from it)."""
    from tiny import build_tiny_causal_lm

    from peagle_pipeline.cache.layout import LAYER_PIECE_PREFIX
    from peagle_pipeline.target_weights import load_target_pieces_from_model

    model = build_tiny_causal_lm(tmp_path / model_type, model_type)
    pieces = load_target_pieces_from_model(model, init_layer=3)
    assert set(pieces) == {"embed_tokens.weight", "lm_head.weight", "norm.weight"}
    assert not any(k.startswith(LAYER_PIECE_PREFIX) for k in pieces)
