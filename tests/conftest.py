"""Shared fixtures: tiny real models (built here, no hub), temporary caches, seeds.

Markers (pyproject.toml): slow, real (SmolLM2/ShareGPT), vllm, crash, crashloop, gpu.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
sys.path.insert(0, str(TESTS_DIR))

from tiny import add_stop_bias, build_tiny_model  # noqa: E402

try:  # property-based tests draw the same examples every run, so CI is repeatable (HYPOTHESIS_PROFILE=explore varies them)
    from hypothesis import settings

    settings.register_profile("repeatable", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
except ImportError:  # the vLLM env may lack hypothesis; its tests do not use it
    pass


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Build (once per session and argument set) a tiny random Llama with a chat template; returns its dir."""
    built: dict[tuple, Path] = {}

    def make(
        template: str = "chatml",
        num_layers: int = 6,
        hidden_size: int = 64,
        vocab_size: int = 512,
        seed: int = 0,
        dtype: str = "bfloat16",
    ) -> Path:
        key = (template, num_layers, hidden_size, vocab_size, seed, dtype)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{template}-{num_layers}l")
            built[key] = build_tiny_model(out, template, num_layers, hidden_size, vocab_size, seed, dtype)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> Path:
    """The default tiny model: ChatML template, 6 layers, hidden 64, vocab 512 (tokenizer 400)."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def tiny_stop_model(tmp_path_factory) -> Path:
    """The default tiny model made to end its replies with <|im_end|> (see tiny.add_stop_bias): sampled replies
    mix stops, empty replies and replies that run to the token limit; greedy replies are empty."""
    out = tmp_path_factory.mktemp("tiny-stop")
    return add_stop_bias(build_tiny_model(out, "chatml", dtype="float32"))


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for CLI subprocesses: this interpreter's scripts first, no debug tracebacks."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PEAGLE_DEBUG", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
