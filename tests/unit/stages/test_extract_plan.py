"""stages.extract.plan: the guide's bytes-per-token table is what the estimator computes from each target's public
config sizes; sizes print in decimal units; a sampled count says how it was made."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_pipeline.cache import estimate as sizes
from peagle_pipeline.stages.extract import plan

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guides" / "extract.md"
# hidden_size, num_hidden_layers, vocab_size of each target's config.json
TARGETS = {
    "Llama-3.1-8B": (4096, 32, 128256),
    "Qwen3-8B": (4096, 36, 151936),
    "gpt-oss-20b": (2880, 24, 201088),
    "Llama-3.1-70B": (8192, 80, 128256),
}
TOKENS_PER_SAMPLE = 1390


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_guide_table_is_the_estimators(name: str) -> None:
    H, L, V = TARGETS[name]
    config = {"hidden_size": H, "num_hidden_layers": L, "vocab_size": V}
    per = [sum(sizes.bytes_per_token(plan.config_shape(config, d)).values()) for d in ("bf16", "fp8", "nf4")]
    sets = [" / ".join(plan.human(b * n * TOKENS_PER_SAMPLE) for b in per) for n in (68_000, 500_000)]
    row = (
        f"| {name} ({H}, {L}, {V:,}) | "
        + " | ".join(f"{b:,.0f}" for b in per)
        + f" | {sets[0]} | {sets[1]} |"
    )
    assert row in GUIDE.read_text().splitlines()
    assert f"at {TOKENS_PER_SAMPLE:,} tokens per sample" in GUIDE.read_text().replace("\n", " ")


def test_human_sizes_and_the_count_line() -> None:
    assert [plan.human(n) for n in (950, 12_340, 4.56e9, 1.2e12, 238e6)] == [
        "950 B", "12.3 kB", "4.56 GB", "1.2 TB", "238 MB",
    ]  # fmt: skip
    assert plan.TokenCount(40, 1, 38, 5000).describe() == "tokens from a tokenisation pass over all 40 rows"
    sampled = plan.TokenCount(17_671, 9, 1700, 2_500_000)
    assert sampled.sampled == 1964 and sampled.scale == pytest.approx(17_671 / 1964)
    assert sampled.describe() == "tokens from 1,964 of 17,671 rows tokenised (1 in 9), scaled"
