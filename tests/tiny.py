"""Tiny real models and tokenizers for tests: a byte-level BPE tokenizer with a real chat template and a
random Llama (head_dim 32, so vLLM's CPU attention accepts it), saved as an ordinary HF model directory; and a
random Qwen3 (QK-norm) with Qwen3's own chat template (tests/fixtures/chat_templates/qwen3.jinja).

Built from scratch in a second; no hub, no mocks. Used by conftest fixtures and by subprocess tests.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATES = {
    # ChatML (SmolLM2, Qwen): role header, content, <|im_end|>.
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Llama-3 style: bos once, header tokens, trimmed content, <|eot_id|>.
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # ChatML that injects a default system prompt when the conversation has none.
    "chatml_system": (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}

# Qwen3's real chat template (Qwen/Qwen3-8B tokenizer_config.json; see tests/fixtures/chat_templates/README.md).
QWEN3_TEMPLATE_FILE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "qwen3.jinja"
# Qwen3's added tokens: the three special ones, then the ordinary added ones its template writes.
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

SPECIAL_TOKENS = [
    "<pad>",
    "<|begin_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CORPUS = [
    "Hello! How are you today? I am fine, thank you very much.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "You are a helpful AI assistant. Answer the question below.",
    "Speculative decoding drafts several tokens and the target model verifies them in parallel.",
    "def add(a, b):\n    return a + b\n",
    "system user assistant tool: What is the capital of France? Paris is the capital of France.",
]


def build_tokenizer(out_dir: str | Path, template: str = "chatml", vocab_size: int = 400):
    """Train a byte-level BPE tokenizer on a tiny corpus and save it with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    eos = "<|eot_id|>" if template == "llama3" else "<|im_end|>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token=eos, pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATES[template]
    fast.save_pretrained(str(out_dir))
    return fast


def build_qwen3_tokenizer(out_dir: str | Path, vocab_size: int = 400):
    """A byte-level BPE tokenizer with Qwen3's added tokens (eos <|im_end|>, pad <|endoftext|>, no bos, `<think>`
    and `<tool_call>` ordinary added tokens as in Qwen3) and Qwen3's real chat template; saved to `out_dir`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN3_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN3_TEMPLATE_FILE.read_text(encoding="utf-8")
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_qwen3(
    out_dir: str | Path, num_layers: int = 4, hidden_size: int = 64, vocab_size: int = 512, seed: int = 0
) -> Path:
    """Save a random tiny Qwen3ForCausalLM (q_norm/k_norm, head_dim 32) with Qwen3's chat template; return the path."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen3_tokenizer(out)
    config = Qwen3Config(
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
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # as build_tiny_model; the QK norms get weights away from 1 so copying them shows
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.to(torch.float32).save_pretrained(str(out))
    (out / "peagle_test_model.json").write_text(json.dumps({"template": "qwen3", "seed": seed}))
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
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
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


CHAT_WORDS = (
    "hello world the quick brown fox jumps over lazy dog speculative decoding drafts tokens target model "
    "verifies parallel capital france paris answer question helpful assistant"
).split()


def write_conversations(
    path: Path, n: int, seed: int = 0, words: list[str] = CHAT_WORDS, max_reply_words: int = 30
) -> Path:
    """n OpenAI-style conversations (1-3 turns each: 3-12 random words asked, 5..max_reply_words answered) as
    JSONL; the same file for the same arguments."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            messages = []
            for _ in range(rng.randint(1, 3)):
                messages.append(
                    {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))}
                )
                messages.append(
                    {
                        "role": "assistant",
                        "content": " ".join(rng.choices(words, k=rng.randint(5, max_reply_words))),
                    }
                )
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
