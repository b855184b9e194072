"""How much of the target's greedy MT-Bench text a draft vocabulary covers (run from the repository root).

    .venv/bin/python bench/results/vocab-cpu-2026-11-27/coverage.py [QUALITY_DIR]

Generates the target's greedy replies (64 new tokens) to the 80 MT-Bench first turns with HF, then prints the share
of those tokens in the exported main draft's vocabulary and in the N most frequent tokens of the caches' counts.
"""

import glob
import sys

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from peagle_pipeline.stages.evaluate.prompts import load_prompts

MODEL = ".demo/models/SmolLM2-135M-Instruct"
PAD = 2  # <|im_end|>, also the end of a reply


def greedy_tokens(model: AutoModelForCausalLM, prompts: list[list[int]]) -> torch.Tensor:
    out: list[int] = []
    for i in range(0, len(prompts), 16):
        batch = prompts[i : i + 16]
        width = max(map(len, batch))
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in batch])
        starts = torch.tensor([width - len(p) for p in batch])
        attention = (torch.arange(width)[None, :] >= starts[:, None]).long()
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids, attention_mask=attention, max_new_tokens=64, do_sample=False, pad_token_id=PAD
            )
        for row in gen[:, width:].tolist():
            out += row[: row.index(PAD) + 1] if PAD in row else row
    return torch.tensor(out)


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else ".quality"
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tokens = greedy_tokens(model, load_prompts("mt-bench", MODEL, 80))
    t2d = load_file(f"{root}/runs/main/export/model.safetensors")["t2d"]
    print(
        "tokens", len(tokens), "in the main draft's vocabulary", round(t2d[tokens].float().mean().item(), 4)
    )
    for name in ("token_counts.npy", "all_token_counts.npy"):
        counts = sum(np.load(f) for f in glob.glob(f"{root}/caches/*/**/{name}", recursive=True))
        order = np.argsort(-counts, kind="stable")
        for size in (8192, 12288, 16384, 24576, 32768, 49152):
            keep = torch.zeros(len(counts), dtype=torch.bool)
            keep[torch.from_numpy(order[:size].copy())] = True
            print(name, size, round(keep[tokens].float().mean().item(), 4))


if __name__ == "__main__":
    main()
