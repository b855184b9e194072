"""VLLM drafts exactly the tokens our draft model computes.

`proposals.compare_proposals` records every K-token proposal of vLLM's drafter on greedy replies and looks up the
argmax of `PEagleDraft.forward_layout` at the same anchor and depth (the forward `train` optimises): they must be
equal at every depth, for a 4-layer draft of the real SmolLM2, a 2-layer draft of a Qwen3 (QK-norm) target, a
Qwen3-style draft layer of a Llama target (`train --draft-arch qwen3`), and
1-layer drafts of a Qwen3-MoE target, of targets with YaRN RoPE (a Qwen3 with its long-context setting, a
gpt-oss), with LongRoPE (a Phi-3), with partial rotary (Qwen3-Next's and Qwen3.5's), of a Gemma 4, a Llama 4 and a Granite. The acceptance that the walk over the replies
implies must equal vLLM's own counters (but for the tokens a step accepted past `max_tokens`, which the reply does
not show), so the recorded proposals are the ones vLLM verified; and `core.loss.acceptance_walk`, which the
trainer reports as `acceptance_walk`, must count the same steps and accepted tokens from our proposals.

An EAGLE-3 draft (`train --method eagle3`) is checked the same way: vLLM drafts its K tokens in sequential steps,
and our forward of the same steps, each fed the previous step's argmax, must give the same tokens.

The drafts are random, with `mask_hidden` zeroed and the layers' and fc's matrices scaled up: the tokens at depths
>= 1 then depend on the context through attention (a random draft's mask state would otherwise fix them), and the
test checks that every depth drafted several different tokens. Trained drafts were checked the same way with the
script form of `proposals.py` (docs/guides/serve.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2, TINY_LAYERS
from drafts import make_random_draft
from proposals import chat_prompts, compare_proposals

K = 4


def _sharpen(export: Path, scale: float) -> None:
    """Zero the draft's `mask_hidden` and scale its layers' and fc's matrices by `scale`, in place."""
    from safetensors.torch import load_file, save_file

    path = export / "model.safetensors"
    weights = load_file(str(path))
    for name, w in weights.items():
        if name == "mask_hidden":
            weights[name] = torch.zeros_like(w)
        elif w.dim() == 2 and name.startswith(("layers.", "fc.")):
            weights[name] = w * scale
    save_file(weights, str(path), metadata={"format": "pt"})


def _check(target: Path, export: Path) -> None:
    c = compare_proposals(target, export, chat_prompts(target), K, max_tokens=40)
    assert c.mismatches == [] and c.equal_per_depth == c.compared_per_depth
    assert c.compared >= 0.9 * c.drafted > 0  # all but the chains that run past the end of a reply
    assert min(c.compared_per_depth) > 0
    assert min(c.distinct_per_depth) >= 3, (
        f"too few different tokens to tell drafts apart: {c.distinct_per_depth}"
    )
    assert c.steps == c.vllm_drafts
    for walk, vllm in zip(c.accepted_per_position, c.vllm_accepted_per_position, strict=True):
        assert walk <= vllm <= walk + c.truncated_steps
    # the trainer's `acceptance_walk` (core.loss) walks the replies as vLLM did
    assert c.core_walk_steps == c.steps and c.core_walk_accepted == sum(c.accepted_per_position)


@pytest.mark.real
@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="SmolLM2 demo assets missing: run `make demo-assets`")
def test_four_layer_draft_of_smollm2(tmp_path: Path) -> None:
    """SmolLM2-135M (30 layers; aux ids 2, 15, 27), a 4-layer draft over an 8,192-token draft vocabulary."""
    export = make_random_draft(
        SMOLLM2, tmp_path / "draft", [2, 15, 27], depths=K, draft_vocab_size=8192, draft_layers=4
    )
    _sharpen(export, 3.0)
    _check(SMOLLM2, export)


def test_two_layer_draft_of_qwen3(tiny_qwen3: Path, tmp_path: Path) -> None:
    """The tiny Qwen3 (QK-norm in the draft layers too), a 2-layer draft over a 300-token draft vocabulary."""
    export = make_random_draft(
        tiny_qwen3, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300, draft_layers=2
    )
    _sharpen(export, 3.0)
    _check(tiny_qwen3, export)


def test_qwen3_style_draft_of_a_llama_target(tiny_model: Path, tmp_path: Path) -> None:
    """`train --draft-arch qwen3` on a Llama target: vLLM serves the Qwen3 draft layer (q_norm/k_norm) beside a
    target without them, computing what our layer computes."""
    export = make_random_draft(tiny_model, tmp_path / "draft", TINY_LAYERS, depths=K, draft_vocab_size=300,
                               qk_norm=True)  # fmt: skip
    layer = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "qwen3"
    _sharpen(export, 3.0)
    _check(tiny_model, export)


def test_draft_of_a_yarn_target(tiny_qwen3_yarn: Path, tmp_path: Path) -> None:
    """A target with YaRN RoPE (gpt-oss, Qwen3 past 32k): vLLM serves the exported rope_parameters (interpolated
    frequencies, attention factor) as the draft computed them in training."""
    export = make_random_draft(tiny_qwen3_yarn, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300)
    layer = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    assert (
        layer["rope_parameters"]["rope_type"] == "yarn" and layer["rope_parameters"]["attention_factor"] > 1
    )
    _sharpen(export, 3.0)
    _check(tiny_qwen3_yarn, export)


def test_draft_of_a_longrope_target(tiny_phi3_longrope: Path, tmp_path: Path) -> None:
    """A Phi-3 target with LongRoPE over three quarters of each head (Phi-4-mini's rotation): the draft exports its
    one factor list as both of LongRoPE's, and vLLM, serving past the original 32 positions (its long list), turns
    the draft's queries and keys by the frequencies and attention factor of training."""
    export = make_random_draft(
        tiny_phi3_longrope, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300
    )
    rope = json.loads((export / "config.json").read_text())["transformer_layer_config"]["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["short_factor"] == rope["long_factor"]
    assert rope["partial_rotary_factor"] == 0.75 and rope["attention_factor"] > 1.2
    _sharpen(export, 3.0)
    _check(tiny_phi3_longrope, export)


def test_draft_with_partial_rotary(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Qwen3-Next's and Qwen3.5's rotation, a quarter of each head (their drafts take it from the target): vLLM
    turns the same dimensions by the same angles as the draft in training. Checked on the tiny Qwen3, whose
    draft is given that rotation, since vLLM runs the hybrids' linear attention on a CPU in bf16 only."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    export = make_random_draft(
        tiny_qwen3, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300, rope_parameters=rope
    )
    layer = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    assert layer["rope_parameters"]["partial_rotary_factor"] == 0.25
    _sharpen(export, 3.0)
    _check(tiny_qwen3, export)


def test_draft_of_a_gemma4_target(tiny_gemma4: Path, tmp_path: Path) -> None:
    """A Gemma 4 target (gelu, norms around attention and MLP, a RoPE per layer type, soft-capped logits): its Llama
    draft layer, at the full-attention layers' RoPE base, drafts in vLLM what it computes here."""
    export = make_random_draft(tiny_gemma4, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300)
    layer = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    assert layer["hidden_act"] == "silu" and layer["rope_parameters"]["rope_theta"] == 1e6
    _sharpen(export, 3.0)
    _check(tiny_gemma4, export)


def test_draft_of_a_gpt_oss_target(tiny_gpt_oss: Path, tmp_path: Path) -> None:
    """A gpt-oss target (mixture of experts, attention sinks, YaRN without truncation): the Llama draft layer with
    the target's attention biases and rotation drafts in vLLM what it computes here."""
    export = make_random_draft(tiny_gpt_oss, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300)
    layer = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    assert layer["attention_bias"] is True and layer["rope_parameters"]["truncate"] is False
    _sharpen(export, 3.0)
    _check(tiny_gpt_oss, export)


def test_draft_of_a_llama4_target(tiny_llama4: Path, tmp_path: Path) -> None:
    """A Llama 4 target (mixture of experts, chunked attention with QK-norm, a last layer without RoPE): the Llama
    draft layer drafts in vLLM what it computes here on the states transformers gives."""
    export = make_random_draft(tiny_llama4, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300)
    _sharpen(export, 3.0)
    _check(tiny_llama4, export)


def test_draft_of_a_granite_target(tiny_granite: Path, tmp_path: Path) -> None:
    """A Granite target (embedding, attention, residual and logit multipliers): the target's aux states that vLLM
    hands its draft are the ones transformers gives, and the draft drafts there what it computes here."""
    export = make_random_draft(tiny_granite, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300)
    _sharpen(export, 3.0)
    _check(tiny_granite, export)


def test_draft_of_a_qwen3_moe_target(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    """A Qwen3-MoE target (Qwen3-30B-A3B's architecture): its Qwen3 draft layer drafts in vLLM what it computes here."""
    export = make_random_draft(tiny_qwen3_moe, tmp_path / "draft", [1, 2, 3], depths=K, draft_vocab_size=300)
    _sharpen(export, 3.0)
    _check(tiny_qwen3_moe, export)


def test_eagle3_draft_of_qwen3(tiny_qwen3: Path, tmp_path: Path) -> None:
    """An EAGLE-3 export (speculators eagle3, served without parallel drafting) of a 2-layer Qwen3 draft: every
    sequential step vLLM drafts is the argmax of our own step, fed our previous step's token and output state."""
    export = make_random_draft(
        tiny_qwen3,
        tmp_path / "draft",
        [1, 2, 3],
        depths=K,
        draft_vocab_size=300,
        draft_layers=2,
        method="eagle3",
    )
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "mask_token_id" not in config
    _sharpen(export, 3.0)
    _check(tiny_qwen3, export)
