"""`evaluate` without vLLM: the counter math, the report built from runs, its table and chart, finding the run of
an export and the trainer's estimate, and the one-line errors (vLLM missing, bad options)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_run import peagle

from peagle_pipeline.backends.generation import vllm_installed
from peagle_pipeline.errors import BadInput
from peagle_pipeline.stages.evaluate.acceptance import EngineRun, SpecCounters, mismatches, ratio
from peagle_pipeline.stages.evaluate.drafts import (
    Draft,
    estimate_of_export,
    exported_step,
    find_run,
    trainer_estimate,
    walk_of_export,
)
from peagle_pipeline.stages.evaluate.prompts import PromptSet
from peagle_pipeline.stages.evaluate.report import format_table, plot_acceptance
from peagle_pipeline.stages.evaluate.stage import EvalOptions, Measured, build_report, finite
from peagle_pipeline.stages.export.marker import MARKER_FILE as EXPORT_MARKER


def test_counter_difference_and_acceptance() -> None:
    before = SpecCounters(drafts=10, draft_tokens=40, accepted=7, per_pos=(5, 2))
    after = SpecCounters(drafts=30, draft_tokens=120, accepted=27, per_pos=(18, 7, 2, 0))
    d = after - before
    assert d == SpecCounters(drafts=20, draft_tokens=80, accepted=20, per_pos=(13, 5, 2, 0))
    assert d.acceptance_length == pytest.approx(1 + 20 / 20)
    assert d.acceptance_per_position == pytest.approx([0.65, 0.25, 0.1, 0.0])
    none = SpecCounters(per_pos=(0, 0))
    assert none.acceptance_length is None and none.acceptance_per_position is None
    assert json.dumps(none.to_json(), allow_nan=False)  # null, never NaN
    assert ratio(3, 0) is None and ratio(3, 2) == 1.5


def test_mismatch_listing() -> None:
    found = mismatches([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9, 9], [6, 7]])
    assert [(m["prompt"], m["first_difference"]) for m in found] == [(1, 1), (2, 1)]
    assert found[0]["plain"] == [5] and found[0]["speculative"] == [9, 9]


def test_finite_replaces_nan_and_inf() -> None:
    out = finite({"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": (2, "x")})
    assert out == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, "x"]}


def _draft(name: str, estimate: dict | None = None) -> Draft:
    return Draft(name=name, path=f"/x/{name}", verifier=None, vocab_size=None, trained_depths=2, depths=2,
                 run=None, estimate=estimate)  # fmt: skip


def _report(temperature: float = 0.0) -> dict:
    opts = EvalOptions(
        drafts=["a", "b"], prompts=["p"], max_tokens=4, concurrency=[4], temperature=temperature, dtype="bf16"
    )
    sets = [PromptSet(name="p", source="p.jsonl", prompts=[[1, 2], [3, 4, 5]])]
    out = [[7, 8, 9, 10], [11, 12]]
    plain = {("p", 1): EngineRun(out, 2.0), ("p", 4): EngineRun(out, 1.0, concurrency=4)}
    c1 = SpecCounters(drafts=4, draft_tokens=8, accepted=3, per_pos=(2, 1))
    spec = {
        ("a", "p", 1): EngineRun(out, 1.0, c1),
        ("a", "p", 4): EngineRun(out, 0.5, c1, concurrency=4),
        ("b", "p", 1): EngineRun([[7, 8, 0, 0], [11, 12]], 4.0, SpecCounters(per_pos=(0, 0))),
        ("b", "p", 4): EngineRun([[7, 8, 0, 0], [11, 12]], 4.0, SpecCounters(per_pos=(0, 0)), concurrency=4),
    }
    est = {"acceptance_length": 1.5, "acceptance_walk": 1.45, "step": 10, "best_acceptance_length": 1.6,
           "best_step": 5, "depths": 2, "exported_acceptance_length": 1.6, "exported_acceptance_walk": 1.55,
           "exported_step": 5, "run": "/r"}  # fmt: skip
    return build_report(
        opts,
        target="/t",
        hardware="CPU X, 2 cores",
        sets=sets,
        drafts=[_draft("a", est), _draft("b")],
        measured=Measured(plain=plain, spec=spec, engine_seconds={"plain": 1.0, "a": 2.0, "b": 3.0}),
        wall_seconds=9.0,
    )


def test_report_figures() -> None:
    report = _report()
    json.dumps(report, allow_nan=False)
    a, b = report["results"]
    assert a["acceptance_length"] == pytest.approx(1.75) and a["acceptance_per_position"] == [0.5, 0.25]
    assert a["identical"] is True and a["mismatched_prompts"] == 0
    assert a["trainer_estimate"] == 1.6  # the exported step's, not the last (1.5)
    assert a["trainer_walk"] == 1.55  # the walk of that same evaluation
    assert [t["concurrency"] for t in a["throughput"]] == [1, 4]
    t1, t4 = a["throughput"]
    assert (t1["tokens_per_s"], t1["plain_tokens_per_s"], t1["speedup"]) == (6.0, 3.0, 2.0)
    assert (t4["tokens_per_s"], t4["plain_tokens_per_s"], t4["speedup"]) == (12.0, 6.0, 2.0)
    for row in (a, t1, t4):  # every figure carries its settings
        assert {row["depths"], row["temperature"], row["max_tokens"], row["hardware"]} == {
            2,
            0.0,
            4,
            "CPU X, 2 cores",
        }
    assert b["acceptance_length"] is None and b["acceptance_per_position"] is None
    assert (
        b["identical"] is False
        and b["mismatched_prompts"] == 1
        and b["mismatches"][0]["first_difference"] == 2
    )
    assert b["trainer_estimate"] is None and b["trainer_walk"] is None
    assert _report(temperature=0.7)["results"][0]["identical"] is None  # no equality claim when sampling

    table = format_table(report)
    assert "1.750  0.50 0.25" in table and "2.00x" in table and "NO (1/2 differ)" in table
    assert (
        "exported step 5 1.600 (walk 1.550), last 1.500 (walk 1.450) at step 10, best 1.600 at step 5"
        in table
        and "1.600 (walk 1.550)  yes" in table
        and "T=0, max 4 new tokens" in table
    )
    assert "--dtype fp32 checks exact equality" in table  # bf16 with a mismatch: the note


def test_chart_is_a_png(tmp_path: Path) -> None:
    path = plot_acceptance(_report(), tmp_path / "acceptance.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def _write_run(run: Path, accs: list[float | None], walks: list[float | None] | None = None) -> None:
    run.mkdir(parents=True)
    (run / "train.yaml").write_text("train:\n  cache: c\n  seed: 0\n  eval_samples: 4\n  depths: 3\n")
    lines = [{"kind": "train", "step": 1, "loss": 1.0}]
    lines += [{"kind": "eval", "step": 10 * (i + 1), "acceptance": a} for i, a in enumerate(accs)]
    for line, walk in zip(lines[1:], walks or [], strict=False):
        line["acceptance_walk"] = walk
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_find_run_and_trainer_estimate(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run, [1.2, 1.5, None, 1.4])
    (run / "export").mkdir()
    assert find_run(run / "export") == run.resolve()  # train's own export sits in the run
    elsewhere = tmp_path / "exports" / "mine"
    elsewhere.mkdir(parents=True)
    assert find_run(elsewhere) is None
    (elsewhere / EXPORT_MARKER).write_text(json.dumps({"run": "../../run"}))  # relative to the export
    assert find_run(elsewhere).resolve() == run.resolve()
    (elsewhere / EXPORT_MARKER).write_text(json.dumps({"run_dir": str(run)}))
    assert find_run(elsewhere) == run
    est = trainer_estimate(run)
    assert est["acceptance_length"] == 1.4 and est["step"] == 40  # the last eval with an estimate
    assert (est["best_acceptance_length"], est["best_step"], est["depths"]) == (1.5, 20, 3)
    assert est["exported_acceptance_length"] is None and est["exported_step"] is None  # no step given
    assert trainer_estimate(run, 20)["exported_acceptance_length"] == 1.5
    assert trainer_estimate(run, 30)["exported_acceptance_length"] is None  # that eval has no estimate
    assert exported_step(elsewhere, run) is None  # a marker without a step
    marker = {"run": str(run.resolve()), "checkpoint": "step-00000020", "step": 20}
    (elsewhere / EXPORT_MARKER).write_text(json.dumps(marker))
    assert exported_step(elsewhere, find_run(elsewhere)) == 20
    assert trainer_estimate(run, exported_step(elsewhere, run))["exported_acceptance_length"] == 1.5
    other = tmp_path / "other"
    _write_run(other, [1.1])
    assert exported_step(elsewhere, other) is None  # the step of another run's checkpoint says nothing here
    # a run is known by its first start, wherever it was moved
    (run / "run.json").write_text(json.dumps({"starts": [{"time": 123.0}]}))
    (elsewhere / EXPORT_MARKER).write_text(json.dumps({**marker, "run": "/moved/away", "run_started": 123.0}))
    assert exported_step(elsewhere, run) == 20
    # the same path, but another run started there
    (elsewhere / EXPORT_MARKER).write_text(json.dumps({**marker, "run_started": 456.0}))
    assert exported_step(elsewhere, run) is None
    (elsewhere / EXPORT_MARKER).write_text("{not json")
    assert exported_step(elsewhere, run) is None and find_run(elsewhere) is None
    assert est["acceptance_walk"] is None and walk_of_export(est) is None  # a run from before the walk
    assert estimate_of_export(None) is None and walk_of_export(None) is None
    assert estimate_of_export({"acceptance_length": 1.4, "exported_acceptance_length": None}) == 1.4
    _write_run(tmp_path / "empty", [None])
    assert trainer_estimate(tmp_path / "empty") is None


def test_trainer_walk_follows_the_estimate(tmp_path: Path) -> None:
    """The walk shown beside an estimate is that of the same evaluation: the exported step's, else the last's."""
    run = tmp_path / "run"
    _write_run(run, [1.2, 1.5, 1.4], walks=[1.18, None, 1.37])
    last = trainer_estimate(run)
    assert (last["acceptance_walk"], walk_of_export(last)) == (1.37, 1.37)
    at_10 = trainer_estimate(run, 10)
    assert (at_10["exported_acceptance_walk"], walk_of_export(at_10)) == (1.18, 1.18)
    at_20 = trainer_estimate(run, 20)  # that evaluation walked nothing: no walk, not the last one's
    assert estimate_of_export(at_20) == 1.5 and walk_of_export(at_20) is None
    assert walk_of_export(trainer_estimate(run, 99)) == 1.37  # an unevaluated step: the last evaluation


def test_bad_options_are_one_line() -> None:
    with pytest.raises(BadInput, match="--max-tokens must be positive"):
        EvalOptions(drafts=["d"], max_tokens=0)
    with pytest.raises(BadInput, match="--concurrency must be positive"):
        EvalOptions(drafts=["d"], concurrency=[1, 0])
    with pytest.raises(BadInput, match="--temperature must be >= 0"):
        EvalOptions(drafts=["d"], temperature=-1.0)


@pytest.mark.skipif(vllm_installed(), reason="this environment has vLLM (tests/vllm covers evaluate there)")
def test_cli_without_vllm_is_one_line(tmp_path: Path, tiny_model: Path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "peagle",
                "speculators_config": {
                    "proposal_methods": [{"speculative_tokens": 3}],
                    "verifier": {"name_or_path": str(tiny_model)},
                },
                "transformer_layer_config": {"vocab_size": 512},
            }
        )
    )
    proc = peagle("evaluate", str(export), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: vLLM is not installed here: run `make setup-vllm` and use .venv-vllm/bin/peagle-pipeline"
    ]
    proc = peagle("evaluate", str(tmp_path / "missing"), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: draft export {tmp_path / 'missing'} not found"
    ]


def test_acceptance_is_read_from_the_concurrency_asked_for() -> None:
    """--acceptance-concurrency C: AL and per-position acceptance come from the run at C, and 1 is not forced."""
    opts = EvalOptions(drafts=["a"], prompts=["p"], max_tokens=4, concurrency=[4], acceptance_concurrency=4)
    assert opts.levels == [4]
    sets = [PromptSet(name="p", source="p.jsonl", prompts=[[1, 2], [3, 4, 5]])]
    out = [[7, 8, 9, 10], [11, 12]]
    at4 = SpecCounters(drafts=4, draft_tokens=8, accepted=4, per_pos=(3, 1))
    report = build_report(
        opts,
        target="/t",
        hardware="CPU X, 2 cores",
        sets=sets,
        drafts=[_draft("a")],
        measured=Measured(
            plain={("p", 4): EngineRun(out, 1.0, concurrency=4)},
            spec={("a", "p", 4): EngineRun(out, 0.5, at4, concurrency=4)},
            engine_seconds={"plain": 1.0, "a": 2.0},
        ),
        wall_seconds=3.0,
    )
    (row,) = report["results"]
    assert row["acceptance_length"] == pytest.approx(2.0) and row["acceptance_per_position"] == [0.75, 0.25]
    assert row["concurrency"] == 4 and report["settings"]["acceptance_concurrency"] == 4
    assert [t["concurrency"] for t in row["throughput"]] == [4]
    with pytest.raises(BadInput, match="--acceptance-concurrency must be positive"):
        EvalOptions(drafts=["d"], acceptance_concurrency=0)


def test_dtype_is_auto_by_default_and_checked() -> None:
    from peagle_pipeline.stages.evaluate.stage import engine_dtype

    assert EvalOptions(drafts=["d"]).dtype == "auto"
    assert engine_dtype("fp32", "t") == "fp32" and engine_dtype("bf16", "t") == "bf16"  # given: used as it is
    with pytest.raises(BadInput, match="--dtype must be auto, bf16 or fp32"):
        EvalOptions(drafts=["d"], dtype="fp16")  # type: ignore[arg-type]


# ---------------------------------------------------------------- drafts of both methods, each at its own K list
def _export(path: Path, method: str, served: int = 3) -> Path:
    """A draft export's config.json (no weights: nothing here loads them)."""
    path.mkdir(parents=True)
    config = {
        "speculators_model_type": method,
        "speculators_config": {"algorithm": method, "proposal_methods": [{"speculative_tokens": served}]},
        "transformer_layer_config": {"vocab_size": 512},
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_k_lists_parse_and_bad_ones_are_one_line() -> None:
    from peagle_pipeline.config.evaluate import parse_depths

    assert parse_depths("4") == [4] and parse_depths("5,3") == [3, 5] and parse_depths("3-5") == [3, 4, 5]
    assert parse_depths("2,4-6,5") == [2, 4, 5, 6]
    for bad in ("0", "5-3", "a", "3-", "", "3;4"):
        with pytest.raises(BadInput, match="K list"):
            parse_depths(bad)
    assert EvalOptions(drafts=["d"], depths="4-6").depth_list == [4, 5, 6]
    assert EvalOptions(drafts=["d"], depths=4).depth_list == [4]  # type: ignore[arg-type]
    assert EvalOptions(drafts=["d"]).depth_list is None
    with pytest.raises(BadInput, match="--depths: K list '0'"):
        EvalOptions(drafts=["d"], depths="0")


def test_a_draft_argument_may_carry_its_own_k_list(tmp_path: Path) -> None:
    from peagle_pipeline.stages.evaluate.drafts import split_draft_arg

    assert split_draft_arg("runs/a/export") == ("runs/a/export", None)
    assert split_draft_arg("runs/a/export@3-5") == ("runs/a/export", [3, 4, 5])
    assert split_draft_arg("runs/a/export@4,8") == ("runs/a/export", [4, 8])
    assert split_draft_arg("me@host/export") == ("me@host/export", None)  # not a K list: part of the path
    odd = tmp_path / "draft@4"
    odd.mkdir()
    assert split_draft_arg(str(odd)) == (str(odd), None)  # an existing directory is taken as it is
    with pytest.raises(BadInput, match="K list '5-3'"):
        split_draft_arg("runs/a/export@5-3")


def test_each_draft_is_measured_at_its_own_ks_and_its_method(tmp_path: Path) -> None:
    from peagle_pipeline.stages.evaluate.acceptance import speculative_config
    from peagle_pipeline.stages.evaluate.stage import _resolve_drafts

    peagle, eagle3 = _export(tmp_path / "pe", "peagle", 4), _export(tmp_path / "e3", "eagle3", 3)
    other = _export(tmp_path / "other", "peagle", 2)
    opts = EvalOptions(drafts=[f"{peagle}@4-6", f"{eagle3}@3,5", str(other)], depths="7")
    got = [(d.name, d.label, d.method, d.depths) for d in _resolve_drafts(opts)]
    assert got == [
        ("pe@4", "pe", "peagle", 4), ("pe@5", "pe", "peagle", 5), ("pe@6", "pe", "peagle", 6),
        ("e3@3", "e3", "eagle3", 3), ("e3@5", "e3", "eagle3", 5),
        ("other", "other", "peagle", 7),  # no K list of its own: --depths'
    ]  # fmt: skip
    assert [d.depths for d in _resolve_drafts(EvalOptions(drafts=[str(other)]))] == [2]  # its served K
    assert speculative_config(peagle, 5) == {
        "model": str(peagle.resolve()), "method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": 5,
    }  # fmt: skip
    assert speculative_config(eagle3, 3) == {
        "model": str(eagle3.resolve()), "method": "eagle3", "num_speculative_tokens": 3,
    }  # fmt: skip
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "config.json").write_text(json.dumps({"speculators_model_type": "dflash"}))
    with pytest.raises(
        BadInput,
        match="is not a draft export \\(speculators_model_type is 'dflash', not one of peagle, eagle3\\)",
    ):
        _resolve_drafts(EvalOptions(drafts=[str(tmp_path / "dflash")]))


def _sweep_report() -> dict:
    """Two drafts: a P-EAGLE at K = 2 and 3 and an EAGLE-3 at K = 2, on one prompt set, at concurrency 1."""
    from dataclasses import replace

    opts = EvalOptions(drafts=["a", "b"], prompts=["p"], max_tokens=4, dtype="fp32")
    sets = [PromptSet(name="p", source="p.jsonl", prompts=[[1, 2], [3, 4, 5]])]
    out = [[7, 8, 9, 10], [11, 12]]
    base = _draft("a")
    drafts = [
        replace(base, name="a@2", group="a", depths=2),
        replace(base, name="a@3", group="a", depths=3),
        replace(_draft("b"), method="eagle3", group="b", depths=2),
    ]
    counters = {
        "a@2": SpecCounters(drafts=4, draft_tokens=8, accepted=2, per_pos=(2, 0)),
        "a@3": SpecCounters(drafts=4, draft_tokens=12, accepted=3, per_pos=(2, 1, 0)),
        "b": SpecCounters(drafts=2, draft_tokens=4, accepted=4, per_pos=(2, 2)),
    }
    seconds = {"a@2": 2.0, "a@3": 1.0, "b": 0.5}
    spec = {(n, "p", 1): EngineRun(out, seconds[n], c) for n, c in counters.items()}
    return build_report(
        opts,
        target="/t",
        hardware="CPU X, 2 cores",
        sets=sets,
        drafts=drafts,
        measured=Measured(
            plain={("p", 1): EngineRun(out, 2.0)},
            spec=spec,
            engine_seconds={"plain": 1.0, **dict.fromkeys(counters, 1.0)},
        ),
        wall_seconds=9.0,
    )


def test_one_table_compares_methods_and_ks(tmp_path: Path) -> None:
    from peagle_pipeline.stages.evaluate.report import _comparison_lines, plot_comparison

    report = _sweep_report()
    json.dumps(report, allow_nan=False)
    rows = {r["draft"]: r for r in report["results"]}
    assert [(r["label"], r["method"], r["depths"]) for r in rows.values()] == [
        ("a", "peagle", 2), ("a", "peagle", 3), ("b", "eagle3", 2),
    ]  # fmt: skip
    assert rows["a@3"]["acceptance_length"] == pytest.approx(1.75) and rows["b"]["acceptance_length"] == 3.0
    assert rows["b"]["throughput"][0]["speedup"] == pytest.approx(4.0)  # 6 tokens in 0.5 s against 2.0 s
    assert [d["parallel_drafting"] for d in report["drafts"]] == [True, True, False]
    assert _comparison_lines(report, "p") == {"a": [(2, 1.5, 1.0), (3, 1.75, 2.0)], "b": [(2, 3.0, 4.0)]}
    table = format_table(report)
    assert "method" in table and "P-EAGLE" in table and "EAGLE-3" in table
    b_row = next(line for line in table.splitlines() if line.startswith("p ") and " b " in line)
    assert "EAGLE-3" in b_row and "3.000" in b_row and "3.0 -> 12.0" in b_row and "4.00x" in b_row
    path = plot_comparison(report, tmp_path / "comparison.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_measured_table_of_a_card() -> None:
    from peagle_pipeline.stages.evaluate.card_table import measured_section

    text = measured_section(_report(), "a")
    assert "| p | 2 | 2 | 1.750 | 0.50 0.25 | 1.600 | yes |" in text  # AL, per position, estimate, = plain
    assert "| p | 1 | 3.0 | 6.0 | 2.00x |" in text and "| p | 4 | 6.0 | 12.0 | 2.00x |" in text
    assert "on CPU X, 2 cores (vLLM" in text and "bf16, T=0, at most 4 new tokens" in text
    assert "| no |" in measured_section(_report(), "b") and "| - | - |" in measured_section(_report(), "b")
