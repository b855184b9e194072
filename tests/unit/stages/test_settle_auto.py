"""Extract settles its "auto" values from one read of cache.json in one pure function, and the
saved-vs-current settings comparison of every resume is one function."""

from __future__ import annotations

from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.core.settings import setting_differences
from peagle_pipeline.stages.extract.batch_plan import DEFAULT_LENGTH_WINDOW
from peagle_pipeline.stages.extract.settings import settle_auto


def _cfg(**kw) -> ExtractConfig:
    return ExtractConfig(model="m", data=["d.jsonl"], output="out", **kw)


def test_a_new_cache_takes_the_defaults():
    cfg, run_cfg, why = settle_auto(_cfg(dtype="fp32"), None, "cpu")
    assert cfg.length_window == DEFAULT_LENGTH_WINDOW and cfg.compute_dtype == "auto"  # as recorded
    assert run_cfg.compute_dtype == "fp32" and run_cfg.length_window == DEFAULT_LENGTH_WINDOW
    assert why == "compute dtype fp32 on cpu (auto: dtype is fp32)"


def test_a_resumed_cache_keeps_what_it_recorded():
    recorded = {"compute_dtype": "bfloat16", "length_window": 7}
    cfg, run_cfg, why = settle_auto(_cfg(dtype="fp32"), recorded, "cpu")
    assert (cfg.length_window, cfg.compute_dtype, run_cfg.compute_dtype) == (7, "auto", "bf16")
    assert why.endswith("(auto: kept from the cache being resumed)")
    # a cache from before the field: row order; explicit settings are used as given
    cfg, run_cfg, _ = settle_auto(
        _cfg(compute_dtype="fp32", length_window=3), {"hidden_dtype": "bfloat16"}, "cpu"
    )
    assert (cfg.length_window, run_cfg.compute_dtype) == (3, "fp32")
    assert settle_auto(_cfg(), {"hidden_dtype": "bfloat16"}, "cpu").cfg.length_window == 1


def test_auto_is_bf16_where_the_backend_runs_the_target_in_bf16_only():
    only = "auto: vLLM's CPU kernel for linear attention runs bf16 only"
    for dtype in ("fp32", "bf16"):  # whatever is stored, and whatever this CPU's bf16 speed
        _, run_cfg, why = settle_auto(_cfg(dtype=dtype, backend="vllm"), None, "cpu", only)
        assert run_cfg.compute_dtype == "bf16" and why == f"compute dtype bf16 on cpu ({only})"
    # a given dtype is used as given (the backend refuses fp32 in one line), a resumed cache keeps its own
    assert settle_auto(_cfg(compute_dtype="fp32"), None, "cpu", only).run_cfg.compute_dtype == "fp32"
    assert settle_auto(_cfg(), {"compute_dtype": "float32"}, "cpu", only).run_cfg.compute_dtype == "fp32"


def test_setting_differences_names_each_setting_once_in_a_stable_order():
    saved, now = {"b": 1, "a": {"x": 1, "y": 2}, "c": 3}, {"a": {"x": 1, "y": 5}, "b": 2, "d": 4, "c": 3}
    assert setting_differences(saved, now) == [
        ("b", 1, 2),
        ("a", {"x": 1, "y": 2}, {"x": 1, "y": 5}),
        ("d", None, 4),
    ]
    assert setting_differences(saved, now, ordered=True, nested=True, ignore={"d"}) == [
        ("a.y", 2, 5),
        ("b", 1, 2),
    ]


def test_vllm_samples_fit_the_targets_positions_and_the_record_keeps_max_length():
    from peagle_pipeline.stages.extract.settings import fit_to_positions

    run_cfg, note = fit_to_positions(_cfg(backend="vllm", max_length=2048), 2048)
    assert run_cfg.max_length == 2047 and "at most 2047 tokens, not max_length 2048" in note
    assert fit_to_positions(_cfg(backend="vllm", max_length=2047), 2048)[1] is None
    assert (
        fit_to_positions(_cfg(backend="vllm", max_length=4096), None)[0].max_length == 4096
    )  # length unknown
    # the HF backend scores a sample's last row itself: nothing to leave out
    assert fit_to_positions(_cfg(backend="hf", max_length=2048), 2048) == (
        _cfg(backend="hf", max_length=2048),
        None,
    )


def _info(layers: int = 30, positions: int = 2048):
    from peagle_pipeline.target_info import TargetInfo

    config = {
        "num_hidden_layers": layers,
        "hidden_size": 64,
        "vocab_size": 100,
        "max_position_embeddings": positions,
    }
    return TargetInfo("m", ["LlamaForCausalLM"], layers, 64, 100, config)


def test_the_plan_records_the_settings_as_given_and_runs_them_settled():
    from peagle_pipeline.stages.extract.settings import settle

    plan = settle(_cfg(dtype="fp32", backend="vllm", max_length=2048), _info(), None, "cpu", (1, 2))
    assert plan.layer_ids == (2, 15, 27) and (plan.rank, plan.world) == (1, 2)
    assert plan.cfg.compute_dtype == "auto" and plan.cfg.max_length == 2048  # what cache.json records
    assert plan.backend.compute_dtype == "fp32" and plan.backend.max_length == 2047  # what the backend runs
    assert plan.why == "compute dtype fp32 on cpu (auto: dtype is fp32)"
    assert len(plan.notes) == 1 and "at most 2047 tokens" in plan.notes[0]
    # a 6-layer target's default ids collapse ([2, 3, 3]): said as a note, not refused
    small = settle(_cfg(dtype="fp32"), _info(layers=6), None, "cpu", (0, 1))
    assert small.layer_ids == (2, 3) and "2 aux hidden states instead of 3" in small.notes[0]


def test_the_plan_refuses_layers_and_topk_the_target_cannot_have():
    import pytest

    from peagle_pipeline.errors import BadInput
    from peagle_pipeline.stages.extract.settings import settle

    with pytest.raises(BadInput, match="layer"):
        settle(_cfg(layers=[2, 31]), _info(), None, "cpu", (0, 1))
    with pytest.raises(BadInput, match="top"):
        settle(_cfg(topk=101), _info(), None, "cpu", (0, 1))
