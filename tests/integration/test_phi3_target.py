"""A Phi-3 target with LongRoPE end to end (Phi-4-mini's rotation: three quarters of each head, short and long
factor lists): extracted, trained from its fused last layer and exported with the real CLI, and transformers' notice
about the config as Phi-3 models ship it kept off the terminal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_run import peagle
from tiny import write_conversations

pytestmark = pytest.mark.slow


def test_a_longrope_target_trains_from_its_layer_and_exports_one_factor_list(
    tiny_phi3_longrope: Path, tmp_path: Path
) -> None:
    data = write_conversations(tmp_path / "conv.jsonl", 16)
    cache, run = tmp_path / "cache", tmp_path / "run"
    extract = peagle(
        *["extract", "--model", str(tiny_phi3_longrope), "--data", str(data), "--output", str(cache)],
        *["--dtype", "fp32", "--max-length", "256", "--layers", "0,1,2"],
    )
    assert "rope_parameters" not in extract.stderr and "[transformers]" not in extract.stderr
    train = peagle(
        *["train", "--cache", str(cache), "--output", str(run), "--depths", "3", "--tokens-per-step", "256"],
        *["--steps", "2", "--eval-every", "2", "--save-every", "2", "--eval-samples", "4"],
        *["--precision", "fp32", "--num-workers", "0"],
    )
    assert "draft layer 0 starts from target layer 3" in train.stderr + train.stdout
    layer = json.loads((run / "export" / "config.json").read_text())["transformer_layer_config"]
    rope = layer["rope_parameters"]
    target = json.loads((tiny_phi3_longrope / "config.json").read_text())
    short = (target.get("rope_parameters") or target["rope_scaling"])["short_factor"]
    assert rope["rope_type"] == "longrope" and rope["short_factor"] == rope["long_factor"] == short
    assert rope["partial_rotary_factor"] == 0.75 and rope["original_max_position_embeddings"] == 32
    assert rope["attention_factor"] == pytest.approx(
        math.sqrt(1 + math.log(8) / math.log(32))
    )  # 256 = 8 x 32
