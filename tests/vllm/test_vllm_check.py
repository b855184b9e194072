"""`peagle-pipeline vllm-check`: exports load in vLLM as parallel-drafting speculators, greedy output is
unchanged, and vLLM's own acceptance counters are reported.

The draft is trained briefly by `peagle-pipeline train` (Vd < V, so d2t/t2d are exercised) on the cache that
`extract --backend vllm` wrote, exported, and checked on the cache's held-out prompts. A random draft written by
our exporter (tests/vllm/drafts.py) serves the fast checks of bad inputs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMOLLM2, TINY_LAYERS, run_cli
from drafts import make_random_draft


@pytest.fixture(scope="module")
def random_draft(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_draft(
        tiny_model, tmp_path_factory.mktemp("draft") / "export", TINY_LAYERS, depths=3, draft_vocab_size=300
    )


def test_trained_draft_from_vllm_cache(
    tiny_model: Path, tiny_caches: dict[str, Path], tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    cache, run = tiny_caches["vllm"], tmp_path / "run"
    proc = run_cli(
        vllm_env,
        "train",
        "--cache",
        str(cache),
        "--output",
        str(run),
        "--steps",
        "40",
        "--depths",
        "3",
        "--draft-vocab-size",
        "300",
        "--tokens-per-step",
        "1024",
        "--eval-samples",
        "4",
        "--eval-every",
        "40",
        "--save-every",
        "40",
        "--warmup",
        "5",
        "--lr",
        "3e-3",
        "--num-workers",
        "0",
        "--device",
        "cpu",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = run / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    report = tmp_path / "check.json"
    proc = run_cli(
        vllm_env,
        "vllm-check",
        str(export),
        "--target",
        str(tiny_model),
        "--prompts",
        str(cache),
        "--num-prompts",
        "4",
        "--max-tokens",
        "24",
        "--report",
        str(report),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print("\n" + proc.stdout)
    data = json.loads(report.read_text())
    assert data["identical"] is True and data["depths"] == 3 and data["prompts"] >= 1
    assert data["drafts"] > 0 and data["acceptance_length"] >= 1.0


def test_not_an_export_is_one_line_error(tmp_path: Path, tiny_model: Path, vllm_env: dict[str, str]) -> None:
    proc = run_cli(vllm_env, "vllm-check", str(tmp_path), "--target", str(tiny_model), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} is not a draft export: cannot read config.json (FileNotFoundError)"
    ]


def test_draft_for_another_vocabulary_is_refused(
    random_draft: Path, tmp_path: Path, tiny_model: Path
) -> None:
    from peagle_pipeline.errors import BadInput
    from peagle_pipeline.stages.evaluate.vllm_check import run

    other = tmp_path / "other"
    shutil.copytree(random_draft, other)
    config = json.loads((other / "config.json").read_text())
    config["transformer_layer_config"]["vocab_size"] = 1024
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match="vocabulary of 1024"):
        run(str(other), str(tiny_model))


def test_draft_for_another_target_is_refused(
    tiny_qwen3: Path, tmp_path: Path, tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    """A draft for the tiny Qwen3 (same vocabulary size) on the tiny Llama: one line, no engine."""
    draft = make_random_draft(tiny_qwen3, tmp_path / "qwen3-draft", [1, 2, 3], depths=3)
    proc = run_cli(vllm_env, "vllm-check", str(draft), "--target", str(tiny_model), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: draft {draft} was trained on another target than {tiny_model} (its config and tokenizer "
        "differ): give the target it was trained on, or --allow-other-target to run it anyway"
    ]


def test_qwen3_draft_layer_loads_and_keeps_greedy_output(
    tiny_qwen3: Path, tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    """A Qwen3 draft layer (q_norm/k_norm, model_type qwen3) loads in vLLM's parallel drafting."""
    draft = make_random_draft(tiny_qwen3, tmp_path / "qwen3-draft", [1, 2, 3], depths=3, draft_vocab_size=300)
    assert (
        json.loads((draft / "config.json").read_text())["transformer_layer_config"]["model_type"] == "qwen3"
    )
    report = tmp_path / "check.json"
    proc = run_cli(
        vllm_env,
        *["vllm-check", str(draft), "--target", str(tiny_qwen3), "--dtype", "fp32", "--num-prompts", "2"],
        *["--max-tokens", "16", "--report", str(report)],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["identical"] and result["drafts"] > 0


def test_eagle3_export_loads_without_parallel_drafting_and_keeps_greedy_output(
    tiny_model: Path, tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    """An EAGLE-3 export (`train --method eagle3`: speculators eagle3, no mask token) is served by vLLM's EAGLE-3
    proposer in K sequential steps; greedy output in fp32 equals plain decoding."""
    draft = make_random_draft(
        tiny_model, tmp_path / "eagle3", TINY_LAYERS, depths=3, draft_vocab_size=300, method="eagle3"
    )
    from peagle_pipeline.stages.evaluate.acceptance import speculative_config

    assert "parallel_drafting" not in speculative_config(draft, 3)
    report = tmp_path / "check.json"
    proc = run_cli(
        vllm_env,
        *["vllm-check", str(draft), "--target", str(tiny_model), "--dtype", "fp32", "--num-prompts", "2"],
        *["--max-tokens", "16", "--report", str(report)],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["identical"] and result["drafts"] > 0 and result["depths"] == 3


@pytest.mark.real
@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="SmolLM2 demo assets missing: run `make demo-assets`")
def test_a_qwen3_style_draft_of_smollm2_keeps_greedy_output(tmp_path: Path, vllm_env: dict[str, str]) -> None:
    """`train --draft-arch qwen3` on SmolLM2 (a Llama target): the Qwen3 draft layer loads in vLLM and, in fp32,
    greedy output equals plain decoding (test_drafts_match_vllm checks its drafted tokens on the tiny Llama)."""
    draft = make_random_draft(SMOLLM2, tmp_path / "draft", [2, 15, 27], depths=3, draft_vocab_size=8192,
                              qk_norm=True)  # fmt: skip
    layer = json.loads((draft / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_attention_heads"] == 9
    report = tmp_path / "check.json"
    proc = run_cli(
        vllm_env,
        *["vllm-check", str(draft), "--target", str(SMOLLM2), "--dtype", "fp32", "--num-prompts", "2"],
        *["--max-tokens", "16", "--report", str(report)],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["identical"] and result["prompts"] == 2 and result["drafts"] > 0


def test_prompt_sources(tiny_model: Path, tiny_chat_data: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from peagle_pipeline.stages.evaluate.vllm_check import DEFAULT_PROMPTS, load_prompts

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    plain = tmp_path / "p.jsonl"
    plain.write_text(
        json.dumps({"prompt": "Hello! How are you today?"}) + "\n\n" + json.dumps({"prompt": "Paris?"}) + "\n"
    )
    for source, n in ((None, len(DEFAULT_PROMPTS)), (str(plain), 2), (str(tiny_chat_data), 5)):
        prompts = load_prompts(source, str(tiny_model), 5 if source else 100)
        assert len(prompts) == n
        for ids in prompts:  # rendered with the chat template, ending with the generation prompt
            assert ids[-len(header) :] == header
    first = load_prompts(str(plain), str(tiny_model), 1)[0]
    assert tok.decode(first).count("Hello! How are you today?") == 1


def test_ctrl_c_says_nothing_is_kept(random_draft: Path, tiny_model: Path, vllm_env: dict[str, str]) -> None:
    """vllm-check writes nothing until it ends: a Ctrl-C must not claim "committed work is kept; ... resume"."""
    exe = str(Path(sys.executable).parent / "peagle-pipeline")
    argv = [exe, "vllm-check", str(random_draft), "--target", str(tiny_model), "--dtype", "fp32"]
    proc = subprocess.Popen(argv, env=vllm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline() if proc.stdout else ""  # our progress line, before the engine starts
        assert first.startswith("plain target "), (first, proc.wait(timeout=300), proc.stderr.read()[-3000:])
        time.sleep(2.0)  # inside vLLM's engine start
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith("error: interrupted: vllm-check keeps no partial work"), lines[-1]
    assert "committed" not in err and "resume" not in err
