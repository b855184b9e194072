"""VLLM's own output goes to a log file, the terminal keeps ours.

`evaluate` with stdout and stderr piped (no terminal), as `make demo` and SLURM run it: vLLM's WARNING lines, the
traceback of its chat-template warm-up (it has no tokenizer here) and transformers' `torch_dtype` deprecation
warning on loading the export all used to reach the user; now they land in OUTPUT/vllm.log, whose path is printed,
and a progress line follows every measured run.
"""

from __future__ import annotations

from pathlib import Path

from conftest import TINY_LAYERS, run_cli
from drafts import make_random_draft


def test_evaluate_prints_ours_and_logs_vllms(
    tiny_model: Path, tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    draft = make_random_draft(tiny_model, tmp_path / "random", TINY_LAYERS, depths=2)
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?"}\n{"prompt": "Hi"}\n')
    out = tmp_path / "eval"
    argv = ["--prompts", str(prompts), "--num-prompts", "2", "--max-tokens", "8", "--dtype", "fp32"]
    proc = run_cli(vllm_env, "evaluate", str(draft), "--target", str(tiny_model), *argv, "--output", str(out))
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-3000:]
    log_file = out / "vllm.log"
    assert f"vLLM's own messages go to {log_file}" in proc.stderr
    for noise in ("WARNING", "Traceback", "torch_dtype", "INFO", "Loading safetensors"):
        assert noise not in terminal, f"{noise!r} reached the terminal:\n{terminal[-3000:]}"
    assert "vllm" in log_file.read_text()  # vLLM's records are kept there
    # one progress line per measured run: the plain target and the draft, one prompt set each
    runs = [line for line in proc.stdout.splitlines() if "in flight: 2 prompts" in line]
    assert len(runs) == 2, proc.stdout
    assert "acceptance" in proc.stdout.lower()  # the results table
