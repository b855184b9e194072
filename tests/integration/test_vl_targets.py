"""Vision-language targets, on text: Qwen3-VL and Qwen2.5-VL checkpoints (…ForConditionalGeneration), which
transformers maps to no causal LM class. Their language models use M-RoPE, which on text (the same position on
every axis) is plain RoPE. Generated, extracted (HF backend), trained and exported with the real CLI; serving them
in vLLM is not tried here (vLLM's CPU build lacks the vision stack such a target needs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_run import peagle
from tiny import build_tiny_vl, write_conversations

pytestmark = pytest.mark.slow

# kind -> what the draft layer is: its exported model_type, and what its start from the last layer says
DRAFT = {
    "qwen3_vl": ("qwen3", "starts from target layer 3 with its q_norm/k_norm"),
    "qwen2_5_vl": ("llama", "starts from target layer 3;"),
}


@pytest.fixture(scope="module", params=sorted(DRAFT))
def vl_target(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build_tiny_vl(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def vl_run(vl_target: tuple[str, Path], tmp_path_factory) -> Path:
    """A 2-step run on the target's cache (3 aux layers, K=3), exported to RUN/export; its terminal in
    RUN/output.txt."""
    tmp = tmp_path_factory.mktemp("vl-run")
    data = write_conversations(tmp / "conv.jsonl", 16)
    cache, run = tmp / "cache", tmp / "run"
    peagle(
        *["extract", "--model", str(vl_target[1]), "--data", str(data), "--output", str(cache)],
        *["--dtype", "fp32", "--max-length", "256", "--layers", "0,1,2"],
    )
    proc = peagle(
        *["train", "--cache", str(cache), "--output", str(run), "--depths", "3", "--tokens-per-step", "256"],
        *["--steps", "2", "--eval-every", "2", "--save-every", "2", "--eval-samples", "4"],
        *["--precision", "fp32", "--num-workers", "0"],
    )
    (run / "output.txt").write_text(proc.stdout + proc.stderr)
    return run


def _target(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_the_cache_holds_the_targets_own_log_probs(vl_run: Path, vl_target: tuple[str, Path]) -> None:
    """The stored top-k log-probs are the vision-language model's own on the same text (it fails when the states
    come from anywhere but its language model's layers and final norm)."""
    from peagle_pipeline.cache.reader import open_cache

    cache = open_cache(str(vl_run.parent / "cache"))
    model = _target(vl_target[1])
    for sample_id in (0, 5):
        s = cache.read_sample(sample_id)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=s.input_ids[None]).logits[0].float(), -1)
        torch.testing.assert_close(logprobs.gather(1, s.topk_ids), s.topk_logprobs, rtol=0, atol=2e-3)


def test_the_draft_starts_from_the_last_layer_with_plain_rope(
    vl_run: Path, vl_target: tuple[str, Path]
) -> None:
    """Qwen3-VL: a Qwen3 layer, q/k norms included; Qwen2.5-VL: a Llama layer with the attention biases. Both
    exported with 1-D RoPE at the target's base: vLLM refuses an M-RoPE draft for parallel drafting and hands a
    text-only draft the first M-RoPE axis."""
    model_type, start = DRAFT[vl_target[0]]
    out = (vl_run / "output.txt").read_text()
    assert "held-out: loss" in out and start in out
    layer = json.loads((vl_run / "export" / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == model_type and (layer["hidden_size"], layer["eos_token_id"]) == (64, 2)
    assert layer["attention_bias"] is (vl_target[0] == "qwen2_5_vl")
    theta = json.loads((vl_target[1] / "config.json").read_text())["text_config"]["rope_parameters"][
        "rope_theta"
    ]
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": theta}


def test_greedy_generate_is_the_targets_argmax(vl_target: tuple[str, Path], tmp_path: Path) -> None:
    """`generate --backend hf` on the vision-language checkpoint: at T = 0 every generated token is the argmax of
    the target's full forward over the row."""
    from peagle_pipeline.data.onpolicy_files import rows_file

    data = write_conversations(tmp_path / "conv.jsonl", 6)
    out = tmp_path / "gen"
    peagle(
        *["generate", "--model", str(vl_target[1]), "--data", str(data), "--output", str(out)],
        *["--backend", "hf", "--temperature", "0", "--max-new-tokens", "12", "--compute-dtype", "fp32"],
        *["--device", "cpu"],
    )
    rows = [json.loads(line) for line in (out / rows_file(0, 1)).read_text().splitlines()]
    model = _target(vl_target[1])
    checked = 0
    for row in rows:
        ids = torch.tensor(row["input_ids"])
        with torch.no_grad():
            argmax = model(input_ids=ids[None]).logits[0].argmax(-1)
        at = [t for t in range(1, len(ids)) if row["loss_mask"][t]]
        assert [int(argmax[t - 1]) for t in at] == [int(ids[t]) for t in at]
        checked += len(at)
    assert checked >= 24
