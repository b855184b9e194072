"""`peagle-pipeline evaluate` in a real vLLM: drafts of both methods side by side on a JSONL prompt set and a run's
held-out split, one of them at two K; the report's figures are consistent with vLLM's counters, greedy output is
unchanged, the charts are PNGs.

The trained P-EAGLE draft comes from `peagle-pipeline train` on the cache `extract --backend vllm` wrote (its export
sits in the run, so the trainer's estimate is found); the EAGLE-3 draft is a random draft written by our exporter in
the speculators `eagle3` format (served without parallel drafting).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import TINY_LAYERS, run_cli
from drafts import make_random_draft

from peagle_pipeline.stages.export.marker import MARKER_FILE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def as_eagle3(export: Path, out: Path) -> Path:
    """A copy of a P-EAGLE export in the speculators EAGLE-3 format: the same layers, no mask token or mask state."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, out)
    config = json.loads((out / "config.json").read_text())
    config["speculators_model_type"] = config["speculators_config"]["algorithm"] = "eagle3"
    del config["mask_token_id"]
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(out / "model.safetensors"))
    del weights["mask_hidden"]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def trained_run(tiny_caches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, vllm_env) -> Path:
    run = tmp_path_factory.mktemp("eval") / "run"
    args = dict(
        steps=30, depths=3, draft_vocab_size=300, tokens_per_step=1024, eval_samples=4, eval_every=15,
        save_every=30, warmup=5, lr=3e-3, num_workers=0, device="cpu",
    )  # fmt: skip
    argv = [x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    proc = run_cli(vllm_env, "train", "--cache", str(tiny_caches["vllm"]), "--output", str(run), *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_both_methods_jsonl_and_heldout(
    tiny_model: Path, trained_run: Path, tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    random_draft = make_random_draft(
        tiny_model, tmp_path / "random", TINY_LAYERS, depths=3, draft_vocab_size=300
    )
    eagle3 = as_eagle3(random_draft, tmp_path / "e3")
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"prompt": p}) for p in ("What is the capital of France?", "def add(a, b):", "Hi")
        )
    )
    out = tmp_path / "eval"
    proc = run_cli(
        vllm_env,
        "evaluate",
        str(trained_run / "export"),
        f"{eagle3}@2,3",  # its own K list: an engine per K
        "--target",
        str(tiny_model),
        "--prompts",
        str(prompts),
        "--prompts",
        f"heldout:{trained_run}",
        "--num-prompts",
        "3",
        "--max-tokens",
        "16",
        "--concurrency",
        "2",
        "--dtype",
        "fp32",
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print("\n" + proc.stdout)
    report = json.loads((out / "report.json").read_text())
    assert (out / "acceptance.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "comparison.png").read_bytes()[:8] == PNG_MAGIC

    assert [s["name"] for s in report["prompt_sets"]] == ["questions", "heldout"]
    assert [s["prompts"] for s in report["prompt_sets"]] == [3, 3]
    assert [d["name"] for d in report["drafts"]] == ["run/export", "e3@2", "e3@3"]
    assert [(d["label"], d["method"], d["parallel_drafting"]) for d in report["drafts"]] == [
        ("run/export", "peagle", True), ("e3", "eagle3", False), ("e3", "eagle3", False),
    ]  # fmt: skip
    assert report["settings"]["concurrency"] == [1, 2] and report["settings"]["temperature"] == 0.0
    assert set(report["engine_start_seconds"]) == {"plain", "run/export", "e3@2", "e3@3"}
    assert all(v > 0 for v in report["engine_start_seconds"].values())

    # the trainer's estimate is the last held-out acceptance of the run's metrics.jsonl
    evals = [json.loads(x) for x in (trained_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in evals if r.get("kind") == "eval"][-1]
    trained, rand, _ = report["drafts"]
    assert trained["trainer_estimate"]["acceptance_length"] == pytest.approx(last["acceptance"])
    assert trained["trainer_estimate"]["step"] == last["step"] and trained["run"] == str(trained_run)
    assert rand["trainer_estimate"] is None and rand["run"] is None
    # ... and, beside vLLM's AL, the estimate of the step the export holds (its marker's)
    step = json.loads((trained_run / "export" / MARKER_FILE).read_text())["step"]
    at_step = [r["acceptance"] for r in evals if r.get("kind") == "eval" and r["step"] == step]
    assert at_step and trained["trainer_estimate"]["exported_step"] == step  # `best`: an evaluated step
    assert trained["trainer_estimate"]["exported_acceptance_length"] == pytest.approx(at_step[-1])

    assert len(report["results"]) == 6  # (1 draft + 1 draft at 2 K) x 2 prompt sets
    depths = {"run/export": 3, "e3@2": 2, "e3@3": 3}
    for r in report["results"]:
        K = depths[r["draft"]]
        assert r["depths"] == K and r["max_tokens"] == 16 and r["concurrency"] == 1 and r["hardware"]
        assert r["method"] == ("peagle" if r["draft"] == "run/export" else "eagle3")
        assert r["identical"] is True and r["mismatched_prompts"] == 0
        assert r["drafts"] > 0
        assert r["acceptance_length"] == pytest.approx(1 + r["accepted"] / r["drafts"])
        per = r["accepted_per_position"]
        assert len(per) == K and sum(per) == r["accepted"] and r["draft_tokens"] == K * r["drafts"]
        assert all(0 <= n <= r["drafts"] for n in per)
        assert all(a >= b for a, b in zip(per, per[1:], strict=False))  # position i needs 0..i-1 accepted
        assert r["acceptance_per_position"] == pytest.approx([n / r["drafts"] for n in per])
        assert [t["concurrency"] for t in r["throughput"]] == [1, 2]
        for t in r["throughput"]:
            assert t["tokens_per_s"] > 0 and t["plain_tokens_per_s"] > 0
            assert t["speedup"] == pytest.approx(t["tokens_per_s"] / t["plain_tokens_per_s"])
            assert t["output_tokens"] == t["plain_output_tokens"]  # greedy: the same tokens with and without
        assert r["throughput"][0]["acceptance_length"] == r["acceptance_length"]
        expected = pytest.approx(at_step[-1]) if r["draft"] == "run/export" else None
        assert r["trainer_estimate"] == expected  # the exported step's estimate, from metrics.jsonl
    assert "trainer est. AL" in proc.stdout and "speedup" in proc.stdout and "EAGLE-3" in proc.stdout
    assert "draft e3@2 (EAGLE-3, K=2)" in proc.stdout and "draft run/export (P-EAGLE, K=3)" in proc.stdout


def test_missing_draft_and_not_an_export(tmp_path: Path, tiny_model: Path, vllm_env: dict[str, str]) -> None:
    proc = run_cli(vllm_env, "evaluate", str(tmp_path / "nope"), "--target", str(tiny_model), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: draft export {tmp_path / 'nope'} not found"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    proc = run_cli(vllm_env, "evaluate", str(tmp_path), "--target", str(tiny_model), timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "is not a draft export" in proc.stderr


def test_a_qwen3_next_draft_serves(tiny_qwen3_next: Path, tmp_path: Path, vllm_env: dict[str, str]) -> None:
    """A Qwen3-Next target (linear attention, gated full attention with partial rotary, mixture of experts): vLLM
    loads its Qwen3 draft layer with the quarter-head rotation beside the hybrid target and drafts with it (auto
    dtype: bf16 on any CPU, vLLM's CPU kernel for linear attention takes nothing else). `test_drafts_match_vllm`
    checks the rotation token for token; the tiny Qwen3.5 is trained in tests/integration (vLLM's Qwen3.5 needs
    torchvision)."""
    export = make_random_draft(tiny_qwen3_next, tmp_path / "draft", [1, 2, 3], depths=3, draft_vocab_size=300)
    layer = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["rope_parameters"]["partial_rotary_factor"] == 0.25
    out = tmp_path / "eval"
    proc = run_cli(
        vllm_env,
        *["evaluate", str(export), "--target", str(tiny_qwen3_next)],  # auto: bf16, the only dtype it runs in
        *["--prompts", "mt-bench", "--num-prompts", "3", "--max-tokens", "16", "--output", str(out)],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads((out / "report.json").read_text())["results"]
    assert result["drafts"] > 0 and len(result["accepted_per_position"]) == 3
    assert result["acceptance_length"] == pytest.approx(1 + result["accepted"] / result["drafts"])
