"""Helpers of the GPU tier: conversations written here and the real `extract` CLI on the tiny model."""

from __future__ import annotations

from pathlib import Path

from tiny import write_conversations


def conversations(path: Path, n: int = 24) -> Path:
    """n conversations of this tier's own words (replies up to 40 words), as JSONL."""
    words = "the quick brown fox jumps over lazy dog paris capital answer question model draft token".split()
    return write_conversations(path, n, seed=0, words=words, max_reply_words=40)


def extract_tiny(model: Path, data: Path, out: Path, *flags: str) -> Path:
    """`peagle-pipeline extract` of the tiny model (the real CLI, in process) into `out`."""
    from cli_run import peagle

    peagle(
        "extract", "--model", str(model), "--data", str(data), "--output", str(out), "--topk", "16", *flags
    )
    return out
