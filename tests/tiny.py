"""Tiny real models and tokenizers for tests: a byte-level BPE tokenizer with a real chat template and a
random Llama (head_dim 32, so vLLM's CPU attention accepts it), saved as an ordinary HF model directory; a
random Qwen3 (QK-norm) with Qwen3's own chat template (tests/fixtures/chat_templates/qwen3.jinja); the Qwen3-family
hybrids (Qwen3-Next, Qwen3.5), a Gemma 4, a gpt-oss, a Phi-3 with LongRoPE and a Llama 4.

Built from scratch in a second; no hub, no mocks. Used by conftest fixtures and by the tests directly.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.tiny import (  # noqa: F401 (the tokenizer and conversations are shared with bench/)
    CHAT_TEMPLATES,
    CHAT_WORDS,
    CONTROL_TOKENS,
    CORPUS,
    build_tokenizer,
    train_bpe,
    write_conversations,
)

# Qwen3's real chat template (Qwen/Qwen3-8B tokenizer_config.json; see tests/fixtures/chat_templates/README.md).
QWEN3_TEMPLATE_FILE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "qwen3.jinja"
# Qwen3's added tokens: the three special ones, then the ordinary added ones its template writes.
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def build_qwen3_tokenizer(out_dir: str | Path, vocab_size: int = 400):
    """A byte-level BPE tokenizer with Qwen3's added tokens (eos <|im_end|>, pad <|endoftext|>, no bos, `<think>`
    and `<tool_call>` ordinary added tokens as in Qwen3) and Qwen3's real chat template; saved to `out_dir`."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(QWEN3_SPECIAL, vocab_size)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN3_TEMPLATE_FILE.read_text(encoding="utf-8")
    fast.save_pretrained(str(out_dir))
    return fast


# gpt-oss's real chat template (harmony; tests/fixtures/chat_templates/README.md) and its special tokens.
GPT_OSS_TEMPLATE_FILE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "gpt-oss.jinja"
HARMONY_SPECIAL = [
    "<|endoftext|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
]


def build_harmony_tokenizer(out_dir: str | Path, vocab_size: int = 400):
    """A byte-level BPE tokenizer with gpt-oss's special tokens (eos `<|return|>`, pad `<|endoftext|>`, no bos) and
    gpt-oss's real chat template; saved to `out_dir`. Its generation_config.json, as gpt-oss's, also stops on
    `<|call|>` and `<|endoftext|>`."""
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(HARMONY_SPECIAL, vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>")
    fast.chat_template = GPT_OSS_TEMPLATE_FILE.read_text(encoding="utf-8")
    fast.save_pretrained(str(out_dir))
    stops = [fast.convert_tokens_to_ids(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    (Path(out_dir) / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return fast


# The language model of the tiny Qwen3-family, vision-language and Gemma targets: 4 layers of width 64 with 2 query
# heads of 32 and 1 key/value head, a 512-token vocabulary.
TINY_TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=4096,
)


def _special_ids(tokenizer) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The bos, eos and pad ids of `tokenizer` as config arguments."""
    return dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _set_weights(model, matrices: float | None = 0.08, norms=None, biases: float | None = None) -> None:  # type: ignore[no-untyped-def]
    """Weights away from transformers' small defaults, so that the layers matter: matrices ~ N(0, `matrices`),
    norm weights ~ U(`norms`), projection biases ~ N(0, `biases`); each left as it is when None."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                if matrices is not None:
                    p.normal_(0.0, matrices)
            elif name.endswith("norm.weight"):
                if norms is not None:
                    p.uniform_(*norms)
            elif name.endswith("proj.bias") and biases is not None:
                p.normal_(0.0, biases)


def build_tiny_qwen3(
    out_dir: str | Path,
    num_layers: int = 4,
    hidden_size: int = 64,
    vocab_size: int = 512,
    seed: int = 0,
    rope_parameters: dict | None = None,
    moe: bool = False,
) -> Path:
    """Save a random tiny Qwen3ForCausalLM (q_norm/k_norm, head_dim 32) with Qwen3's chat template; return the path.
    `rope_parameters` replaces the default RoPE (e.g. YaRN; its factor x original length sets the maximum length);
    `moe` makes it a Qwen3MoeForCausalLM (4 experts of which 2 per token, in every layer)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen3_tokenizer(out)
    experts = {"num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden_size}
    config = (Qwen3MoeConfig if moe else Qwen3Config)(
        **(experts if moe else {}),
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if rope_parameters is not None:
        config.rope_parameters = {"rope_theta": 10000.0, **rope_parameters}
        if "original_max_position_embeddings" in rope_parameters:
            config.max_position_embeddings = int(
                rope_parameters["original_max_position_embeddings"] * rope_parameters.get("factor", 1)
            )
    torch.manual_seed(seed)
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config)
    with torch.no_grad():  # as build_tiny_model; the QK norms get weights away from 1 so copying them shows
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.to(torch.float32).save_pretrained(str(out))
    (out / "peagle_test_model.json").write_text(json.dumps({"template": "qwen3", "seed": seed}))
    return out


def build_tiny_qwen3_hybrid(out_dir: str | Path, kind: str = "qwen3_next", seed: int = 0) -> Path:
    """Save a random tiny Qwen3-family hybrid with Qwen3's chat template; return the path. Layers 0-2 are linear
    attention (gated delta rule), layer 3 gated full attention with partial rotary (a quarter of each head) and
    zero-centred norms (stored near 0). `kind`: "qwen3_next" (Qwen3NextForCausalLM: mixture-of-experts MLPs with a
    shared expert; linear heads of 128, the size vLLM's CPU kernel takes) or "qwen3_5" (a multimodal
    Qwen3_5ForConditionalGeneration checkpoint, as Qwen3.5 ships: dense MLPs, the language model under
    `text_config` and `model.language_model.*`, a one-block vision tower)."""
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen3_tokenizer(out)
    text = dict(
        **TINY_TEXT,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128 if kind == "qwen3_next" else 32,
        linear_value_head_dim=128 if kind == "qwen3_next" else 32,
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if kind == "qwen3_next":
        experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
        config = Qwen3NextConfig(
            **text, **experts, shared_expert_intermediate_size=64, tie_word_embeddings=False
        )
        model_cls = Qwen3NextForCausalLM
    elif kind == "qwen3_5":
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
        }
        config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
        model_cls = Qwen3_5ForConditionalGeneration
    else:
        raise ValueError(f"unknown kind {kind!r}")
    torch.manual_seed(seed)
    model = model_cls(config)
    _set_weights(model, norms=(-0.5, 0.5))  # norms near 0 (zero-centred: near unit scale) but not at it
    model.to(torch.float32).save_pretrained(str(out))
    return out


def build_tiny_vl(out_dir: str | Path, kind: str = "qwen3_vl", seed: int = 0) -> Path:
    """Save a random tiny vision-language checkpoint with Qwen3's chat template; return the path. `kind`:
    "qwen3_vl" (Qwen3VLForConditionalGeneration: a Qwen3 language model with q/k norms and interleaved M-RoPE) or
    "qwen2_5_vl" (Qwen2_5_VLForConditionalGeneration: Qwen2 attention with q/k/v biases, M-RoPE); either with the
    language model under `text_config` and a one-block vision tower. transformers maps neither to a causal LM
    class."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen3_tokenizer(out)
    text = dict(
        **TINY_TEXT,
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    if kind == "qwen3_vl":
        rope = {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True}
        config = Qwen3VLConfig(
            text_config={**text, "rope_scaling": rope},
            vision_config={**vision, "deepstack_visual_indexes": []},
            tie_word_embeddings=False,
        )
        model_cls = Qwen3VLForConditionalGeneration
    elif kind == "qwen2_5_vl":
        rope = {"rope_type": "default", "mrope_section": [4, 6, 6]}
        config = Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": rope},
            vision_config={**vision, "fullatt_block_indexes": [0]},
            tie_word_embeddings=False,
        )
        model_cls = Qwen2_5_VLForConditionalGeneration
    else:
        raise ValueError(f"unknown kind {kind!r}")
    torch.manual_seed(seed)
    model = model_cls(config)
    _set_weights(model, norms=(0.5, 1.5), biases=0.1)
    model.to(torch.float32).save_pretrained(str(out))
    return out


def build_tiny_gemma3(out_dir: str | Path, seed: int = 0, multimodal: bool = False) -> Path:
    """Save a random tiny Gemma 3 (gelu MLPs, norms on both sides of attention and MLP, q/k norms, zero-centred RMS
    norms that scale by 1 + w, stored away from 0 here; sliding layers with a local RoPE base, no logit soft-cap)
    with the chatml tokenizer; return the path. Gemma3ForCausalLM, or with `multimodal` a
    Gemma3ForConditionalGeneration as Gemma 3 4B-27B ship (the language model under `text_config`, a one-layer
    SigLIP vision tower)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, "chatml")
    text = dict(**TINY_TEXT, sliding_window=16, final_logit_softcapping=None)
    ids = dict(
        **_special_ids(tokenizer),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    if multimodal:
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        image_ids = dict(image_token_index=5, boi_token_index=6, eoi_token_index=7)
        config = Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, **image_ids, **ids
        )
        model = Gemma3ForConditionalGeneration(config)
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**text, **ids))
    _set_weights(model, matrices=None, norms=(-0.5, 0.5))
    model.to(torch.float32).save_pretrained(str(out))
    return out


def build_tiny_gemma4(out_dir: str | Path, seed: int = 0) -> Path:
    """Save a random tiny Gemma4ForCausalLM (gelu MLPs, norms after attention and MLP as well as before, sliding
    layers with one RoPE and a full-attention layer with another, wider heads and partial "proportional" rotary,
    per-layer inputs, logits soft-capped at 30) with the chatml tokenizer; return the path."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, "chatml")
    config = Gemma4TextConfig(
        **TINY_TEXT,
        sliding_window=16,
        vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=16,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        **_special_ids(tokenizer),
    )
    torch.manual_seed(seed)
    Gemma4ForCausalLM(config).to(torch.float32).save_pretrained(str(out))
    return out


def build_tiny_causal_lm(out_dir: str | Path, model_type: str, seed: int = 0, **config: object) -> Path:
    """Save a random tiny causal LM of any transformers `model_type` (TINY_TEXT's sizes, `config` on top) with the
    chatml tokenizer; return the path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = _special_ids(build_tokenizer(out, "chatml"))
    cfg = AutoConfig.for_model(model_type, **{**TINY_TEXT, "tie_word_embeddings": False, **ids, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    _set_weights(model)
    model.to(torch.float32).save_pretrained(str(out))
    return out


def build_tiny_phi3(out_dir: str | Path, seed: int = 0) -> Path:
    """Save a random tiny Phi3ForCausalLM (fused qkv_proj and gate_up_proj) with Phi-4-mini's kind of RoPE: LongRoPE
    over three quarters of each head, from an original context of 32 positions x 8, whose short and long factor
    lists are equal (transformers picks a list by the sequence's length, vLLM by the server's context: equal lists
    make them run one target); chatml tokenizer; return the path."""
    pairs = int(TINY_TEXT["head_dim"] * 0.75) // 2
    factors = [1.0 + 0.4 * i for i in range(pairs)]
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return build_tiny_causal_lm(
        out_dir,
        "phi3",
        seed,
        max_position_embeddings=256,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=32,
        rope_parameters={**rope, "short_factor": factors, "long_factor": factors},
    )


def build_tiny_llama4(out_dir: str | Path, seed: int = 0, multimodal: bool = False) -> Path:
    """Save a random tiny Llama 4 with the chatml tokenizer; return the path. Its language model as Llama 4 Scout's:
    mixture-of-experts MLPs (4 experts, 1 per token, and a shared expert) in every layer, chunked attention with
    weightless QK-norm in the RoPE layers, the fourth layer without RoPE (temperature-tuned attention), the checkpoint
    prefix `language_model`. Chunks of 128 tokens (vLLM's smallest). `multimodal`: a Llama4ForConditionalGeneration
    with a one-layer vision tower, as Llama 4 ships; else the text-only Llama4ForCausalLM."""
    import torch
    from transformers import (
        Llama4Config,
        Llama4ForCausalLM,
        Llama4ForConditionalGeneration,
        Llama4TextConfig,
        Llama4VisionConfig,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = Llama4TextConfig(
        **TINY_TEXT,
        intermediate_size_mlp=TINY_TEXT["intermediate_size"],
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=128,
        tie_word_embeddings=False,
        **_special_ids(build_tokenizer(out, "chatml")),
    )
    torch.manual_seed(seed)
    if multimodal:
        vision = Llama4VisionConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=56,
            patch_size=14,
            vision_output_dim=64,
            projector_input_dim=64,
            projector_output_dim=64,
        )
        config = Llama4Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False
        )
        model = Llama4ForConditionalGeneration(config)
    else:
        model = Llama4ForCausalLM(text)
    _set_weights(model)
    model.to(torch.float32).save_pretrained(str(out))
    return out


def build_tiny_gpt_oss(
    out_dir: str | Path, num_layers: int = 4, hidden_size: int = 64, seed: int = 0
) -> Path:
    """Save a random tiny GptOssForCausalLM (mixture-of-experts MLPs, attention biases and sinks, alternating
    sliding-window layers, YaRN RoPE with gpt-oss's settings from an original context of 32 positions) with the
    chatml tokenizer; return the path."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, "chatml")
    yarn = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    config = GptOssConfig(
        vocab_size=512,
        hidden_size=hidden_size,
        intermediate_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
        rope_parameters={**yarn, "rope_theta": 150000.0, "original_max_position_embeddings": 32},
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )
    torch.manual_seed(seed)
    GptOssForCausalLM(config).to(torch.float32).save_pretrained(str(out))
    return out


def build_tiny_model(
    out_dir: str | Path,
    template: str = "chatml",
    num_layers: int = 6,
    hidden_size: int = 64,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """Save a random tiny LlamaForCausalLM (+ tokenizer) to `out_dir` and return the path.

    vocab_size is larger than the tokenizer on purpose: the first unused embedding row becomes the mask token.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, template)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger-than-default weights so activations and top-k are not all ~uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.to(getattr(torch, dtype)).save_pretrained(str(out))
    (out / "peagle_test_model.json").write_text(json.dumps({"template": template, "seed": seed}))
    return out


def add_stop_bias(model_dir: str | Path, logit: float = 5.0, token: str | None = None) -> Path:
    """Make a tiny model end its replies: the end-of-turn token's lm_head row is set so that its logit is about
    `logit` on a typical final hidden state (the model's mean direction), other logits being ~N(0, 1).

    With logit 5 and sampling at T=1, about 1 reply in 10 is empty, 1 in 6 runs past 40 tokens and the rest stop
    after a few tokens; greedy decoding always stops at once. Rewrites the model in place; returns the path.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eot = tok.convert_tokens_to_ids(token or tok.eos_token)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(10, 400, (8, 64), generator=g)
    with torch.no_grad():
        mu = model.model(x).last_hidden_state.float().reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[eot] = (logit * mu / mu.dot(mu)).to(model.lm_head.weight.dtype)
    model.save_pretrained(str(model_dir))
    return Path(model_dir)
