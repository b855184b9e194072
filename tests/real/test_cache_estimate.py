"""The size `extract` estimates before it runs, against the cache it then writes: SmolLM2-135M on ShareGPT rows
(the demo's target and data), an nf4 cache (where the top-k arrays, sized by measured compression, weigh most)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_pipeline.cache import estimate as sizes
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.data.chat import ChatRenderer
from peagle_pipeline.model_dir import load_tokenizer, read_target_info
from peagle_pipeline.stages.extract import plan, stage
from peagle_pipeline.stages.extract.settings import settle

pytestmark = [pytest.mark.real, pytest.mark.slow]


def test_the_estimate_is_within_10_percent_of_a_real_cache(
    smollm2_dir: Path, sharegpt_jsonl: Path, tmp_path: Path
) -> None:
    cfg = ExtractConfig(model=str(smollm2_dir), data=[str(sharegpt_jsonl)], output=str(tmp_path / "cache"),
                        max_samples=12, max_length=512, dtype="nf4", batch_tokens=4096)  # fmt: skip
    info = read_target_info(smollm2_dir)
    renderer = ChatRenderer(load_tokenizer(str(smollm2_dir)), cfg.assistant_turns, cfg.leading_assistant)
    est = plan.estimate(settle(cfg, info, None, "cpu", (0, 1)), renderer)
    summary = stage.run(cfg)
    assert est.count.step == 1 and est.tokens == summary.tokens
    actual = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    assert abs(est.total - actual) / actual < 0.10, (est.describe(), actual)
    stores = sum(f.stat().st_size for f in (tmp_path / "cache" / "stores").rglob("*") if f.is_file())
    # the stores alone (the total is mostly target/, 120 MB of embedding and LM head, at this size)
    in_stores = est.tokens * est.per_token + sizes.fixed_bytes(est.shape, 1, summary.samples)
    assert abs(in_stores - stores) / stores < 0.10, (in_stores, stores)
