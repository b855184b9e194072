"""Helpers of the GPU tier: conversations written here and the real `extract` CLI on the tiny model."""

from __future__ import annotations

import json
import random
from pathlib import Path


def conversations(path: Path, n: int = 24) -> Path:
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog paris capital answer question model draft token".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            messages = []
            for _ in range(rng.randint(1, 3)):
                messages.append(
                    {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 12)))}
                )
                messages.append(
                    {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(5, 40)))}
                )
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def extract_tiny(model: Path, data: Path, out: Path, *flags: str) -> Path:
    """`peagle-pipeline extract` of the tiny model (real CLI, subprocess) into `out`."""
    from cli_argv import run_peagle

    run_peagle(
        "extract", "--model", str(model), "--data", str(data), "--output", str(out), "--topk", "16", *flags
    )
    return out
