"""Real-tier fixtures: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) and ShareGPT, prepared by scripts/prepare_demo.py.

Uses REPO/.demo when already prepared (`make demo-assets`), otherwise runs the preparation once (about a minute).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / ".demo"
MODEL = DEMO / "models" / "SmolLM2-135M-Instruct"
DATA = DEMO / "data" / "sharegpt.jsonl"


def _prepare() -> None:
    if not ((MODEL / "model.safetensors").is_file() and DATA.is_file()):
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "prepare_demo.py"), "--out", str(DEMO)], check=True
        )


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The dequantised SmolLM2-135M-Instruct model directory (bf16 safetensors + tokenizer with ChatML)."""
    _prepare()
    return MODEL


@pytest.fixture(scope="session")
def sharegpt_jsonl() -> Path:
    """ShareGPT V3: the 17,671 complete records of the truncated file, one per line."""
    _prepare()
    return DATA
