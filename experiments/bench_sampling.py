"""What top-p costs vLLM's CPU sampler: a bare `LLM.generate` of ShareGPT first turns (docs/guides/generate.md).

    .venv-vllm/bin/python experiments/bench_sampling.py N_PROMPTS TEMPERATURE KV_CACHE_GIB [MAX_NUM_SEQS]
    TOPP=1.0 .venv-vllm/bin/python experiments/bench_sampling.py 111 0.7 2

Reads the first N records of .quality/data/train_sources.jsonl (written by `make quality`), keeps first user turns of
at most 512 tokens, generates at most 160 tokens per prompt (per-request seeds, stop on <|im_end|>) and prints the
generated tokens/s. TOPP (default 0.95) applies when TEMPERATURE > 0; DTYPE (default bfloat16) is the engine's dtype
(float32 on a host where the dtype rule picks fp32).
"""

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".demo" / "models" / "SmolLM2-135M-Instruct"
SOURCES = REPO / ".quality" / "data" / "train_sources.jsonl"


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    n, temperature, kv_gib = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    tok = AutoTokenizer.from_pretrained(MODEL)
    prompts = []
    for line in SOURCES.read_text(encoding="utf-8").split("\n")[:n]:
        row = json.loads(line)
        turns = row.get("conversations") or row.get("messages") or []
        first = next((m for m in turns if (m.get("from") or m.get("role")) in ("human", "user")), None)
        if first is None:
            continue
        text = first.get("value") or first.get("content")
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        if len(ids) <= 512:
            prompts.append({"prompt_token_ids": ids})
    engine = dict(
        model=str(MODEL),
        dtype=os.environ.get("DTYPE", "bfloat16"),
        enforce_eager=True,
        kv_cache_memory_bytes=kv_gib << 30,
        skip_tokenizer_init=True,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
        max_model_len=1024,
        seed=0,
    )
    if len(sys.argv) > 4:
        engine["max_num_seqs"] = int(sys.argv[4])
    llm = LLM(**engine)
    top_p = float(os.environ.get("TOPP", "0.95")) if temperature > 0 else 1.0
    params = [
        SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=160, seed=i, stop_token_ids=[2], detokenize=False
        )
        for i in range(len(prompts))
    ]
    start = time.time()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.time() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    print(
        f"prompts={len(prompts)} T={temperature} top_p={top_p} tokens={tokens} s={seconds:.1f} tok/s={tokens / seconds:.1f}"
    )


if __name__ == "__main__":
    main()
