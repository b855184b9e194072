"""The `extract` command: this rank's rows -> chat rendering -> deterministic batches (`batch_plan.py`) -> target
backend -> CacheWriter, one batch behind the backend (`batch_pipeline.py`).

Resuming is exact because the batch plan is a pure function of the rank's row sequence and the settings: a
resumed run re-forms the same batches, skips those whose samples are all committed, recomputes the batch that
holds the first uncommitted sample, and the writer drops tokens it already has. Never decides storage layout
(that is `cache/`) and never branches on the backend name.
"""

from __future__ import annotations

import collections
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from peagle_pipeline.backends import vllm_log
from peagle_pipeline.backends.base import TargetBackend
from peagle_pipeline.backends.registry import get_backend
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.location import read_recorded_meta, remove_new_cache
from peagle_pipeline.cache.remote import RemoteCache, is_remote
from peagle_pipeline.cache.writer import CacheWriter
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.errors import BadInput
from peagle_pipeline.runtime import check_output_dir, writer_rank
from peagle_pipeline.stages.extract import plan as extract_plan
from peagle_pipeline.stages.extract.batch_pipeline import BatchPipeline
from peagle_pipeline.stages.extract.batch_plan import RowReject, plan_batches, render_rows, sort_by_length
from peagle_pipeline.stages.extract.cache_output import build_meta, prepare_output, raise_if_unwritable
from peagle_pipeline.stages.extract.generated_data import check_generated_data
from peagle_pipeline.stages.extract.settings import ExtractPlan, check_target, settle, target_device
from peagle_pipeline.stages.rank_run import Progress, open_beside, run_rank, this_rank_rows
from peagle_pipeline.stages.tokenizer_facts import tokenizer_facts

if TYPE_CHECKING:
    from peagle_pipeline.core.vocab import TokenizerFacts
    from peagle_pipeline.data.chat import ChatRenderer
    from peagle_pipeline.target_info import TargetInfo

__all__ = ["run", "plan", "ExtractSummary"]

log = logging.getLogger(__name__)


@dataclass
class ExtractSummary:
    """What one `extract` call did (for the rank it ran), printed by the CLI."""

    output: str
    store: str
    samples: int = 0
    tokens: int = 0
    supervised: int = 0
    rejects: dict[str, int] = field(default_factory=dict)
    new_tokens: int = 0
    elapsed_s: float = 0.0
    store_bytes: int = 0
    already_complete: bool = False
    compute_dtype: str = ""  # the line saying the forward's dtype and why (empty when nothing was computed)
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        if self.already_complete:
            head = f"{self.store} in {self.output} is already complete: nothing to do"
        else:
            rate = self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
            head = (
                f"extracted {self.store} in {self.output}: {self.new_tokens} new tokens in "
                f"{self.elapsed_s:.1f} s ({rate:.0f} tokens/s)"
            )
        per_token = f", {self.store_bytes / self.tokens:.1f} bytes/token" if self.tokens else ""
        lines = [
            head,
            f"samples {self.samples}, tokens {self.tokens}, supervised {self.supervised}{per_token}",
        ]
        if self.compute_dtype:
            lines.append(self.compute_dtype)
        total = sum(self.rejects.values())
        lines.append(
            f"rejects {total}"
            + "".join(f"\n  {n:6d}  {r}" for r, n in sorted(self.rejects.items(), key=lambda kv: -kv[1]))
        )
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- run
def run(cfg: ExtractConfig) -> ExtractSummary:
    """Extract (or resume) this rank's store of the cache at cfg.output. See the module docstring.

    Raises:
        BadInput, BadConfig, OutputExists, IncompatibleCache, ResumeMismatch, Busy, OutOfSpace, Interrupted (Ctrl-C), Terminated (SIGTERM).
    """
    from peagle_pipeline.data.formats import split_notes
    from peagle_pipeline.model_dir import read_target_info

    info = read_target_info(cfg.model)
    check_target(cfg, info)  # before the data and the output are looked at
    renderer = _checked_renderer(cfg)
    place = _place(cfg.output)
    plan = _settle(cfg, info, read_recorded_meta(place.local))
    meta = build_meta(plan)
    existed, created = Path(place.local).exists(), not (Path(place.local) / layout.CACHE_META).exists()
    # a new cache: the estimated size against the free space, refused before anything is loaded or written
    start_line = _check_space(plan, renderer) if created else None
    # A new cache is stamped (cache.json: compute dtype, ...) only once its backend has started, so a failed start
    # (no CUDA, vLLM missing, ...) leaves nothing that would refuse or change the corrected command.
    if cfg.backend == "vllm":  # vLLM's own output: OUTPUT/vllm.log, a temporary file until the output exists
        vllm_log.route_to(place.local if place.remote is None and Path(place.local).is_dir() else None)
    backend = _start_new(plan, Path(place.local)) if created else None
    root, writer = _open_store(plan, meta, place, backend, tokenizer_facts(renderer.tokenizer))
    summary = ExtractSummary(output=cfg.output if place.remote is not None else str(root), store=writer.store)
    summary.notes += [*plan.notes, *split_notes(cfg.data, cfg.split)]
    if writer.complete:
        return _already_complete(plan, summary, writer, backend, place.remote)
    if (
        start_line is None
    ):  # a resumed cache: checked with its committed bytes counted, before the target loads
        start_line = _check_space(plan, renderer, writer)
    print(start_line, file=sys.stderr, flush=True)  # once every check passed: a refused run prints one line
    summary.compute_dtype = f"{plan.why}; stored hidden states {cfg.dtype}"
    log.info("%s", summary.compute_dtype)
    start = time.perf_counter()
    work = _StoreWork(plan, writer, renderer, summary, backend, lambda: _remove_new(root, existed, place))
    run_rank(
        work, fresh=created, world=plan.world, unwritable=lambda err: raise_if_unwritable(err, cfg.output)
    )
    summary.elapsed_s = time.perf_counter() - start
    return _unstage(_finish(summary, writer, already=False), place.remote, writer)


def _check_space(plan: ExtractPlan, renderer: ChatRenderer, writer: CacheWriter | None = None) -> str:
    """The start line: the cache's estimated size and the output's free space (`extract_plan.check_space`); an
    open `writer` (a resumed store) is released when it refuses.

    Raises:
        OutOfSpace: the file system cannot hold what is left to write.
    """
    room = extract_plan.estimate(plan, renderer)
    try:
        return extract_plan.check_space(room, _plan_local(plan.cfg.output), plan.cfg.space_check)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


def plan(cfg: ExtractConfig) -> str:
    """`extract --plan`: the estimated cache size and the output's free space, from the tokenizer and config.json
    alone (no weights loaded, nothing written)."""
    from peagle_pipeline.model_dir import read_target_info

    info = read_target_info(cfg.model)
    check_target(cfg, info)
    renderer = _checked_renderer(cfg)
    room = extract_plan.estimate(_settle(cfg, info, read_recorded_meta(cfg.output)), renderer)
    return extract_plan.check_space(room, _plan_local(cfg.output), refuse=False)


def _settle(cfg: ExtractConfig, info: TargetInfo, recorded: dict[str, Any] | None) -> ExtractPlan:
    """The run's plan (`settle`) on this process's rank and device, `recorded` the resumed cache's cache.json."""
    device = target_device(cfg)
    rank_world = writer_rank(cfg.rank, cfg.world_size)
    return settle(cfg, info, recorded, device, rank_world, _bf16_only(cfg, device))


def _plan_local(output: str) -> str | None:
    """The local directory whose file system is checked; None for an object store (not checked)."""
    return None if is_remote(output) else output


def _bf16_only(cfg: ExtractConfig, device: str) -> str | None:
    """Why the backend runs this target in bf16 only on `device`, or None (see `settle_auto`)."""
    if cfg.backend != "vllm":
        return None
    from peagle_pipeline.backends.vllm_dtype import bf16_only_reason

    return bf16_only_reason(cfg.model, device)


def _checked_renderer(cfg: ExtractConfig) -> ChatRenderer:
    """The chat renderer of the target's tokenizer, once the data paths are checked (no row is read).

    Checked before the output exists: bad data paths or tokenizer must not leave a cache stamped with them.
    """
    from peagle_pipeline.data.chat import ChatRenderer
    from peagle_pipeline.data.formats import iter_rows
    from peagle_pipeline.model_dir import load_tokenizer

    iter_rows(cfg.data, cfg.split)  # checks every path's existence and kind; reads nothing
    for warning in check_generated_data(cfg.data, cfg.model, cfg.allow_other_target):
        print(warning, file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(cfg.model)
    return ChatRenderer(tokenizer, cfg.assistant_turns, cfg.leading_assistant, cfg.chat_template_kwargs)


class _Place(NamedTuple):
    """Where the cache is written: cfg.output, or an object store written through a local staging directory
    holding what the writer needs of it."""

    remote: RemoteCache | None
    local: str  # the directory written: cfg.output, or the staging directory
    remote_had: bool  # the object store already held the cache (its root was pulled into `local`)


def _place(output: str) -> _Place:
    remote = RemoteCache(output) if is_remote(output) else None
    local = str(remote.staging) if remote is not None else output
    return _Place(remote, local, remote.pull_root() if remote is not None else False)


def _open_store(
    plan: ExtractPlan, meta: CacheMeta, place: _Place, backend: TargetBackend | None, facts: TokenizerFacts
) -> tuple[Path, CacheWriter]:
    """Create or check the cache (pushed to the object store, if any; a new one keeps the tokenizer's `facts`) and
    open this rank's writer; a started `backend` is closed if that fails."""

    def open_output() -> tuple[Path, CacheWriter]:
        root = prepare_output(plan.cfg, meta, root=place.local, tokenizer_facts=facts)
        if place.remote is not None:
            place.remote.push_root(meta)
        return root, CacheWriter(root, meta, plan.rank, plan.world, remote=place.remote).open()

    try:
        return open_beside(open_output, backend)
    except OSError as err:
        raise_if_unwritable(err, plan.cfg.output)
        raise


def _already_complete(
    plan: ExtractPlan,
    summary: ExtractSummary,
    writer: CacheWriter,
    backend: TargetBackend | None,
    remote: RemoteCache | None,
) -> ExtractSummary:
    """The summary of a store an earlier run finished (nothing to compute; a started `backend` is closed)."""
    writer.abort()
    if backend is not None:
        backend.close()
    if writer.committed_samples == 0 and plan.world == 1:  # written by a version that allowed it
        raise BadInput(
            f"{_no_samples(plan.cfg, writer)}; remove {plan.cfg.output} and re-run with usable data"
        )
    return _unstage(_finish(summary, writer, already=True), remote, writer)


def _remove_new(root: Path, existed: bool, place: _Place) -> None:
    """Remove a cache this call created (and its object-store root, if this call put it there)."""
    remove_new_cache(root, existed)
    if place.remote is not None and not place.remote_had:
        place.remote.remove_root()


def _start_new(plan: ExtractPlan, root: Path) -> TargetBackend:
    """The backend of a new cache, started before anything is written; the output directory is checked first
    (a foreign directory is refused before a slow start).

    Raises:
        OutputExists, BadConfig (vLLM missing), and whatever the backend's start raises (BadInput: no CUDA, ...).
    """
    check_output_dir(root, layout.CACHE_META, "a peagle cache")
    return _backend(plan)


def _backend(plan: ExtractPlan) -> TargetBackend:
    return get_backend(plan.cfg.backend, plan.backend, list(plan.layer_ids))


def _unstage(summary: ExtractSummary, remote: RemoteCache | None, writer: CacheWriter) -> ExtractSummary:
    """Drop the staging copy of a finished store written to an object store (the object store holds it)."""
    if remote is not None:
        shutil.rmtree(writer.store_dir, ignore_errors=True)
    return summary


def _no_samples(cfg: ExtractConfig, writer: CacheWriter) -> str:
    """The error for a store without a single usable sample, naming the most frequent reject reasons."""
    from peagle_pipeline.data.records import most_common_reasons

    data = ", ".join(cfg.data)
    if not writer.num_rejects:
        return f"no usable samples: {data} holds no rows; nothing was written"
    top = most_common_reasons(r["reason"] for r in writer.rejects)
    return f"no usable samples in {data}: all {writer.num_rejects} rows were rejected ({top}); nothing was written"


@dataclass
class _StoreWork:
    """This rank's store as `run_rank` runs it: the batch loop over the rank's rows, committing as it goes.

    `backend` is the one started for a new cache, or None (then the loop starts one at the first batch that is not
    committed yet); `remove` removes the new cache when this (only) rank has no usable sample."""

    plan: ExtractPlan
    writer: CacheWriter
    renderer: ChatRenderer
    summary: ExtractSummary
    backend: TargetBackend | None
    remove: Callable[[], None]

    def loop(self) -> None:
        cfg, writer, meta = self.plan.cfg, self.writer, self.writer.meta
        rows = this_rank_rows(cfg.data, cfg.split, self.plan.rank, self.plan.world, cfg.max_samples)
        samples = render_rows(rows.rows, self.renderer, self.plan.backend.max_length, cfg.overlong)
        items = plan_batches(sort_by_length(samples, meta.length_window), cfg.batch_tokens)
        progress = Progress(rows.total, writer.store, ("sample", "samples"))

        def advance(n: int) -> None:  # rows written or rejected; the tokens written count in the rate
            progress.tokens = ahead.new_tokens
            progress.advance(n)

        ahead = BatchPipeline(writer, advance)
        try:
            progress.banner(self.summary.compute_dtype)
            for item in items:
                if isinstance(item, RowReject):
                    ahead.reject(item)
                elif item[-1].ordinal < writer.next_ordinal:  # committed by an earlier run
                    progress.skip(len(item))
                else:
                    if self.backend is None:
                        self.backend = _backend(self.plan)
                    ahead.submit(self.backend, item)
                    progress.set_tokens(ahead.new_tokens)
            ahead.drain()
        finally:
            progress.close()
        self.summary.new_tokens = ahead.new_tokens

    def committed(self) -> str:
        return f"{self.writer.committed_samples} samples of {self.writer.store}"

    def nothing_usable(self) -> str | None:
        return _no_samples(self.plan.cfg, self.writer) if self.writer.next_ordinal == 0 else None

    def finish(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()

    def remove_new(self) -> None:
        self.remove()

    def close_backend(self) -> None:
        if self.backend is not None:
            self.backend.close()


def _finish(summary: ExtractSummary, writer: CacheWriter, already: bool) -> ExtractSummary:
    summary.already_complete = already
    summary.samples = writer.committed_samples
    summary.tokens = writer.committed_tokens
    summary.supervised = writer.committed_supervised
    summary.rejects = dict(collections.Counter(r["reason"] for r in writer.rejects))
    summary.store_bytes = sum(f.stat().st_size for f in writer.store_dir.rglob("*") if f.is_file())
    return summary
