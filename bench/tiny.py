"""Tiny real inputs that the benchmarks and the tests share: a byte-level BPE tokenizer with a real chat template
(trained on a tiny corpus in a second, no hub) and generated chat conversations. tests/tiny.py builds its tiny
models on them.
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

CONTROL_TOKENS = [
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


def train_bpe(special_tokens: list[str], vocab_size: int = 400):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the tiny corpus, with `special_tokens` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def build_tokenizer(out_dir: str | Path, template: str = "chatml", vocab_size: int = 400):
    """Train a byte-level BPE tokenizer on a tiny corpus and save it with a chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(CONTROL_TOKENS, vocab_size)
    eos = "<|eot_id|>" if template == "llama3" else "<|im_end|>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token=eos, pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATES[template]
    fast.save_pretrained(str(out_dir))
    return fast


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
