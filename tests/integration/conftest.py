"""Integration fixtures: real caches built once per session with the real `peagle-pipeline extract` CLI (run in
process, tests/cli_run.py) on the tiny model, from JSONL conversations generated here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import peagle
from tiny import write_conversations

cli = peagle  # `peagle-pipeline ARGS` to completion, in process (tests/cli_run.py)


def _extract(tiny_model: Path, out: Path, data: Path, *extra: str) -> Path:
    cli(
        "extract",
        "--model",
        str(tiny_model),
        "--data",
        str(data),
        "--output",
        str(out),
        "--dtype",
        "fp32",
        "--max-length",
        "256",
        "--shard-tokens",
        "2048",
        "--chunk-tokens",
        "256",
        *extra,
    )
    return out


@pytest.fixture(scope="session")
def conversations(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("data") / "conv.jsonl", 40)


@pytest.fixture(scope="session")
def tiny_cache(tiny_model, conversations, tmp_path_factory) -> Path:
    """A complete fp32 cache of 40 tiny conversations (top-k 32, no last hidden)."""
    return _extract(tiny_model, tmp_path_factory.mktemp("cache") / "cache", conversations)


@pytest.fixture(scope="session")
def tiny_cache_last_hidden(tiny_model, conversations, tmp_path_factory) -> Path:
    """The same data with the pre-norm last hidden state (for exact targets)."""
    return _extract(tiny_model, tmp_path_factory.mktemp("cache") / "cache-lh", conversations, "--last-hidden")


@pytest.fixture(scope="session")
def other_tiny_cache(tiny_model, tmp_path_factory) -> Path:
    """The same tiny target on other conversations (24, seed 1): another held-out set."""
    data = write_conversations(tmp_path_factory.mktemp("data") / "other.jsonl", 24, seed=1)
    return _extract(tiny_model, tmp_path_factory.mktemp("cache") / "other", data)


@pytest.fixture(scope="session")
def foreign_tiny_cache(tiny_model_factory, conversations, tmp_path_factory) -> Path:
    """The default conversations through another tiny target (4 layers: other config, other aux layer ids)."""
    model = tiny_model_factory(num_layers=4)
    return _extract(model, tmp_path_factory.mktemp("cache") / "foreign", conversations)
