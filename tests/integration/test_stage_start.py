"""What `generate` and `extract` leave behind when they cannot start or have nothing to do.

A new output is stamped (generate.json, cache.json: backend, compute dtype) only once its backend has started: a
failed start (vLLM not installed, `--device cuda` without CUDA) is one line and leaves nothing, so the command the
error suggests runs as a new one. A single-rank `generate` that keeps no row (an empty file, every prompt over the
limit) is an error, as `extract`'s is, and leaves nothing. The real CLI, in process, on a tiny real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import peagle

from peagle_pipeline.backends.generation import vllm_installed
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.config import ExtractConfig, GenerateConfig
from peagle_pipeline.data.dialogue import REASON_TOO_LONG
from peagle_pipeline.errors import BadInput
from peagle_pipeline.hardware import resolve_compute_dtype
from peagle_pipeline.stages.extract import stage as extract_stage
from peagle_pipeline.stages.generate import stage as generate_stage

FLAGS = ["--max-samples", "3", "--max-new-tokens", "8", "--compute-dtype", "auto"]


def _generate(model: Path, data: Path, out: Path, *extra: str, check: bool = False):
    argv = ["generate", "--model", str(model), "--data", str(data), "--output", str(out), *FLAGS, *extra]
    return peagle(*argv, check=check)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_generate_with_vllm_missing_is_one_line_and_the_suggested_command_then_runs(
    tiny_stop_model, conversations, tmp_path
):
    if vllm_installed():
        pytest.skip("vLLM is installed in this environment (make test's .venv has none)")
    out = tmp_path / "gen"
    proc = _generate(tiny_stop_model, conversations, out, "--backend", "vllm")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: --backend vllm needs vLLM") and "--backend hf" in proc.stderr
    assert not out.exists()  # nothing written before the backend is known to load
    proc = _generate(tiny_stop_model, conversations, out, "--backend", "hf", check=True)
    assert json.loads((out / "generate.json").read_text())["settings"]["backend"] == "hf"


def test_a_failed_cuda_start_stamps_nothing_and_the_cpu_retry_is_a_new_run(
    tiny_stop_model, tiny_model, conversations, tmp_path
):
    if _cuda():
        pytest.skip("CUDA is available here: --device cuda starts")
    cpu_dtype = resolve_compute_dtype("auto", "cpu")
    out = tmp_path / "gen"
    proc = _generate(tiny_stop_model, conversations, out, "--backend", "hf", "--device", "cuda")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--device cpu" in proc.stderr
    assert not out.exists()
    cfg = GenerateConfig(
        model=str(tiny_stop_model), data=[str(conversations)], output=str(out), backend="hf", device="cpu",
        max_samples=3, max_new_tokens=8,
    )  # fmt: skip
    generate_stage.run(cfg)  # the retry the error suggests: not refused, and stamped with the CPU's dtype
    assert json.loads((out / "generate.json").read_text())["settings"]["compute_dtype"] == cpu_dtype

    cache = tmp_path / "cache"
    argv = [
        "--model",
        str(tiny_model),
        "--data",
        str(conversations),
        "--output",
        str(cache),
        "--max-samples",
        "3",
    ]
    proc = peagle("extract", *argv, "--device", "cuda", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--device cpu" in proc.stderr
    assert not cache.exists()
    cfg = ExtractConfig(
        model=str(tiny_model), data=[str(conversations)], output=str(cache), device="cpu", max_samples=3
    )
    summary = extract_stage.run(cfg)
    assert "kept from the cache" not in summary.compute_dtype  # the CPU's own choice, not CUDA's left behind
    assert open_cache(cache).meta.compute_dtype == {"bf16": "bfloat16", "fp32": "float32"}[cpu_dtype]


def test_generate_that_keeps_no_row_is_an_error_and_leaves_nothing(tiny_stop_model, conversations, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "gen"
    proc = _generate(tiny_stop_model, empty, out, "--backend", "hf")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no rows to generate from" in proc.stderr
    assert not out.exists()
    proc = peagle(
        "extract",
        "--model",
        str(tiny_stop_model),
        "--data",
        str(empty),
        "--output",
        str(tmp_path / "c"),
        check=False,
    )
    assert proc.returncode == 2  # the same file, the same answer as extract's

    # generate's own output (rows of token ids) as its input: nothing to prompt with, one line naming why
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n' * 2)
    proc = _generate(tiny_stop_model, ids, out, "--backend", "hf")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert 'every row was rejected (2 x "token ids, not chat messages' in errors[0] and not out.exists()

    given = tmp_path / "given"
    given.mkdir()  # a directory the user made stays, empty
    cfg = GenerateConfig(
        model=str(tiny_stop_model), data=[str(conversations)], output=str(given), backend="hf", device="cpu",
        max_samples=3, max_new_tokens=8, max_prompt_tokens=3,
    )  # fmt: skip
    with pytest.raises(
        BadInput, match=rf"every row was rejected \(3 x '{REASON_TOO_LONG}'\); nothing was kept"
    ):
        generate_stage.run(cfg)
    assert given.is_dir() and list(given.iterdir()) == []


@pytest.mark.parametrize("command", ["extract", "train"])
def test_sigterm_during_start_up_is_143_and_says_nothing_was_committed(
    command, tiny_model, conversations, tiny_cache, tmp_path, monkeypatch, capsys
):
    """A real SIGTERM to this process while the command starts (loading the target's facts; setting up the
    process group): exit 143, "terminated", and no claim of kept work where none was done."""
    import os
    import signal

    from peagle_pipeline import model_dir
    from peagle_pipeline.cli import main
    from peagle_pipeline.stages.train import distributed

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM was not delivered")

    out = tmp_path / "out"
    if command == "extract":
        monkeypatch.setattr(model_dir, "read_target_info", terminated)
        argv = ["extract", "--model", str(tiny_model), "--data", str(conversations), "--output", str(out)]
    else:
        monkeypatch.setattr(distributed.Dist, "setup", staticmethod(terminated))
        argv = ["train", "--cache", str(tiny_cache), "--output", str(out)]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 143 and err.count("\n") == 1, err
    assert err.startswith("error: terminated (SIGTERM) before this command committed any work")
    assert not out.exists()
