"""Train at K = 8, serve at K = 4 (P-EAGLE trains deeper than it serves), with the draft trained by two
FSDP ranks (`torchrun ... train --fsdp`, gloo): the export records speculative_tokens 4 and the trained K apart,
vLLM's own speculators conversion takes K = 4 from it (what `vllm serve DRAFT` drafts), and vLLM loads the draft
at K = 4 with greedy output unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import run_cli


def test_fsdp_draft_trained_at_8_loads_in_vllm_at_4(
    tiny_model: Path, tiny_caches: dict[str, Path], tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["-m", "peagle_pipeline.cli", "train", "--fsdp", "--cache", str(tiny_caches["hf"])]
    argv += ["--output", str(run), "--depths", "8", "--steps", "6", "--tokens-per-step", "256"]
    argv += ["--draft-vocab-size", "300", "--eval-samples", "4", "--eval-every", "6", "--save-every", "6"]
    argv += ["--warmup", "1", "--lr", "3e-3", "--num-workers", "0", "--device", "cpu", "--precision", "fp32"]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env={**vllm_env, "OMP_NUM_THREADS": "1"}, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fsdp: optimizer state per rank" in proc.stderr

    export = run / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert json.loads((export / ".peagle-export.json").read_text())["trained_depths"] == 8

    from vllm.transformers_utils.config import maybe_override_with_speculators

    model, _, spec = maybe_override_with_speculators(str(export), None, trust_remote_code=False)
    assert model == config["speculators_config"]["verifier"]["name_or_path"]
    assert spec is not None and spec["num_speculative_tokens"] == 4
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True

    report = tmp_path / "check.json"
    proc = run_cli(
        vllm_env,
        "vllm-check",
        str(export),
        "--target",
        str(tiny_model),
        "--prompts",
        str(tiny_caches["hf"]),
        "--num-prompts",
        "2",
        "--max-tokens",
        "16",
        "--dtype",
        "fp32",
        "--report",
        str(report),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["depths"] == 4 and data["identical"] is True and data["drafts"] > 0
