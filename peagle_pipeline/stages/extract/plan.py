"""The disk an extraction needs, said before the target runs: the final cache size estimated from the data (a
tokenisation pass over the rows, or over an even sample of them), the target's config, the aux layers, the stored
dtype and top-k; and the refusal to start when the output's file system cannot hold it.

Only the tokenizer and config.json are read (never the weights): `extract --plan` reads every row once (to count
them) and tokenises at most SAMPLE_ROWS of them, about 20 s of CPU for the demo's 17,671 ShareGPT rows. The
estimate covers the whole cache (every rank's store): a resumed cache needs only what it does not hold yet.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from peagle_pipeline.cache import estimate as sizes
from peagle_pipeline.cache.estimate import CacheShape
from peagle_pipeline.errors import OutOfSpace
from peagle_pipeline.stages.extract.cache_output import LOGICAL_DTYPE
from peagle_pipeline.target_info import default_layer_ids

if TYPE_CHECKING:
    from peagle_pipeline.stages.extract.settings import ExtractPlan

__all__ = [
    "SAMPLE_ROWS", "MARGIN", "TokenCount", "Estimate", "count_tokens", "estimate", "check_space", "human",
    "config_shape",
]  # fmt: skip

SAMPLE_ROWS = 2000  # rows tokenised at most: beyond, every k-th row, and the total scaled by the row count
MARGIN = 0.10  # free space asked beyond the estimate (its error on real data is within a few percent)


@dataclass(frozen=True, slots=True)
class TokenCount:
    """Rows of the data (after max_samples), how many were tokenised, and what those gave (rejects give 0)."""

    rows: int
    step: int  # every step-th row was tokenised (1: all)
    samples: int
    tokens: int

    @property
    def sampled(self) -> int:
        return math.ceil(self.rows / self.step)

    @property
    def scale(self) -> float:
        return self.rows / self.sampled if self.sampled else 0.0

    def describe(self) -> str:
        if self.step == 1:
            return f"tokens from a tokenisation pass over all {self.rows:,} rows"
        return f"tokens from {self.sampled:,} of {self.rows:,} rows tokenised (1 in {self.step}), scaled"


def count_tokens(plan: ExtractPlan, renderer: Any, sample_rows: int = SAMPLE_ROWS) -> TokenCount:
    """Tokens and samples the whole cache's rows give, rendered as the stage renders them (the backend's max_length,
    the overlong and turn settings): every row when there are at most `sample_rows`, else every k-th
    (k = ceil(rows / sample_rows)), in row order."""
    from peagle_pipeline.stages.extract.batch_plan import PlannedSample, render_rows
    from peagle_pipeline.stages.rank_run import this_rank_rows

    cfg = plan.cfg
    rows = this_rank_rows(cfg.data, cfg.split, 0, 1, cfg.max_samples)  # every rank's rows: the whole cache
    step = max(1, math.ceil(rows.total / sample_rows))
    picked = (r for r in rows.rows if r[0] % step == 0)
    samples = tokens = 0
    for item in render_rows(picked, renderer, plan.backend.max_length, cfg.overlong):
        if isinstance(item, PlannedSample):
            samples += 1
            tokens += len(item.input_ids)
    return TokenCount(rows.total, step, samples, tokens)


@dataclass(frozen=True, slots=True)
class Estimate:
    """The final size of a cache, in bytes, and how it was reached."""

    count: TokenCount
    shape: CacheShape
    per_token: float  # stored bytes per token, all arrays
    fixed: float  # target/ pieces, count tables, per-sample rows

    @property
    def tokens(self) -> int:
        return round(self.count.tokens * self.count.scale)

    @property
    def total(self) -> int:
        return round(self.tokens * self.per_token + self.fixed)

    def describe(self) -> str:
        return (
            f"estimated cache size {human(self.total)} ({self.tokens:,} tokens x {self.per_token:,.0f} bytes/token "
            f"+ {human(self.fixed)} target pieces and tables; {self.count.describe()})"
        )


def estimate(plan: ExtractPlan, renderer: Any) -> Estimate:
    """The final size of the cache `plan` writes: its target (config.json), aux layers, stored dtype, top-k and
    stores (one per rank), and the tokens its rows give (`count_tokens`)."""
    from peagle_pipeline.model_dir import text_config

    cfg, info = plan.cfg, plan.info
    shape = CacheShape(
        info.hidden_size, len(plan.layer_ids), LOGICAL_DTYPE[cfg.dtype], cfg.topk, info.vocab_size,
        cfg.last_hidden, cfg.compress, cfg.chunk_tokens,
    )  # fmt: skip
    count = count_tokens(plan, renderer)
    per_token = sum(sizes.bytes_per_token(shape).values())
    config = {**info.config, **text_config(info.config)}
    fixed = sizes.fixed_bytes(shape, plan.world, round(count.samples * count.scale))
    fixed += sizes.pieces_bytes(config)  # with the decoder layer the draft starts from
    fixed += sum(p.stat().st_size for p in _target_files(cfg.model))
    return Estimate(count, shape, per_token, fixed)


def _target_files(model: str) -> list[Path]:
    from peagle_pipeline.model_dir import target_files

    return target_files(model)


def check_space(est: Estimate, local: str | None, refuse: bool = True) -> str:
    """The start line: the estimate and the free space of the output's file system (`local`: the output
    directory; None for an object store, which is not checked).

    Raises:
        OutOfSpace: less free space than the estimate (less what the output already holds) plus MARGIN, when
            `refuse` (the `space_check` setting).
    """
    if local is None:
        return f"{est.describe()}; free space not checked: the output is an object store"
    where = _existing_parent(Path(local))
    free = shutil.disk_usage(where).free
    held = _bytes_under(Path(local))
    needed = max(0, est.total - held)
    line = f"{est.describe()}; {human(free)} free in {where}"
    if held:
        line += f" ({human(held)} already written)"
    if needed * (1 + MARGIN) > free and refuse:
        raise OutOfSpace(
            f"not enough free space for the cache: {human(needed)} still to write by the estimate "
            f"(+{MARGIN:.0%} margin), {human(free)} free in {where}; free some space, choose another --output, "
            f"or pass --no-space-check to start anyway ({est.describe()})"
        )
    return line


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path if path.is_dir() else path.parent


def _bytes_under(path: Path) -> int:
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human(n: float) -> str:
    """Bytes in decimal units: 950 B, 12.3 kB, 4.56 GB, 1.20 TB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def config_shape(
    config: dict[str, Any], dtype: Literal["bf16", "fp32", "fp8", "nf4"], topk: int = 32
) -> CacheShape:
    """The cache shape of a target's config.json under the default aux layers ([2, L//2, L-3]) and the other
    defaults; `dtype` as `--dtype` spells it (bf16, fp32, fp8, nf4)."""
    from peagle_pipeline.model_dir import text_config

    text = {**config, **text_config(config)}
    n_aux = len(default_layer_ids(int(text["num_hidden_layers"])))
    return CacheShape(int(text["hidden_size"]), n_aux, LOGICAL_DTYPE[dtype], topk, int(text["vocab_size"]))
