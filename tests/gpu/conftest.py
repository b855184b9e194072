"""GPU tier (`pytest -m gpu`, `make test-gpu`, scripts/gpu_tier.sh): every test here is marked `gpu` and skipped,
with the reason, where CUDA is not available (the project's own machines have no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA (GPU tier; run scripts/gpu_tier.sh on a GPU machine)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 comparisons mean fp32: no TF32 matmuls while a test runs."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


from gpu_helpers import conversations, extract_tiny  # noqa: E402


@pytest.fixture(scope="session")
def gpu_conversations(tmp_path_factory) -> Path:
    return conversations(tmp_path_factory.mktemp("gpu-data") / "conv.jsonl")


@pytest.fixture(scope="session")
def tiny_cache_cuda(tiny_model, gpu_conversations, tmp_path_factory) -> Path:
    """The tiny model's cache extracted on CUDA with the defaults (stored bf16, compute auto = bf16)."""
    return extract_tiny(
        tiny_model, gpu_conversations, tmp_path_factory.mktemp("gpu") / "cuda", "--device", "cuda"
    )
