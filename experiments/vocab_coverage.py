"""How much of the target's greedy MT-Bench text a draft vocabulary covers (run from the repository root).

    .venv/bin/python experiments/vocab_coverage.py [QUALITY_DIR] [--model DIR] [--prompts N] [--max-new-tokens N]

Generates the target's greedy replies to the MT-Bench first turns with HF, then prints the share of those tokens in
the vocabulary of QUALITY_DIR/runs/main/export (a `make quality` directory, default .quality) and in the N most
frequent tokens of the token counts of the caches under QUALITY_DIR/caches.
"""

import argparse
import glob

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from peagle_pipeline.stages.evaluate.prompts import load_prompts

MODEL = ".demo/models/SmolLM2-135M-Instruct"


def greedy_tokens(
    model: AutoModelForCausalLM, prompts: list[list[int]], max_new_tokens: int, pad: int
) -> torch.Tensor:
    """Every generated token, each reply cut after its first `pad` (the end-of-reply token, also the padding)."""
    out: list[int] = []
    for i in range(0, len(prompts), 16):
        batch = prompts[i : i + 16]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        starts = torch.tensor([width - len(p) for p in batch])
        attention = (torch.arange(width)[None, :] >= starts[:, None]).long()
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        for row in gen[:, width:].tolist():
            out += row[: row.index(pad) + 1] if pad in row else row
    return torch.tensor(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=".quality", help="a `make quality` directory")
    ap.add_argument("--model", default=MODEL, help="the target (HF directory)")
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns to generate from")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--pad-id", type=int, default=2, help="end-of-reply token id (SmolLM2's <|im_end|>)")
    args = ap.parse_args()
    root = args.root
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts = load_prompts("mt-bench", args.model, args.prompts)
    tokens = greedy_tokens(model, prompts, args.max_new_tokens, args.pad_id)
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
