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
import os
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
from peagle_pipeline.data.records import rank_rows
from peagle_pipeline.errors import BadInput
from peagle_pipeline.preemption import stop_error
from peagle_pipeline.runtime import check_output_dir, writer_rank
from peagle_pipeline.stages.extract.batch_pipeline import BatchPipeline
from peagle_pipeline.stages.extract.batch_plan import RowReject, plan_batches, render_rows, sort_by_length
from peagle_pipeline.stages.extract.cache_output import build_meta, prepare_output, raise_if_unwritable
from peagle_pipeline.stages.extract.generated_data import check_generated_data
from peagle_pipeline.stages.extract.settings import (
    backend_settings,
    collapsed_layers_note,
    fit_to_positions,
    resolve_layers,
    settle_auto,
    target_device,
)
from peagle_pipeline.stages.tokenizer_facts import tokenizer_facts

if TYPE_CHECKING:
    from peagle_pipeline.core.vocab import TokenizerFacts
    from peagle_pipeline.data.chat import ChatRenderer

__all__ = ["run", "ExtractSummary"]

log = logging.getLogger(__name__)

LINE_EVERY_S = 10.0  # plain progress lines (no terminal): at most one per this many seconds


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
    from peagle_pipeline.model_dir import read_target_info, text_config

    rank, world = writer_rank(cfg.rank, cfg.world_size)
    info = read_target_info(cfg.model)
    layer_ids = resolve_layers(cfg, info.num_hidden_layers)
    if cfg.topk > info.vocab_size:
        raise BadInput(f"topk {cfg.topk} exceeds the target vocabulary ({info.vocab_size})")
    renderer = _checked_renderer(cfg)
    place = _place(cfg.output)
    device = target_device(cfg)
    cfg, run_cfg, why = settle_auto(cfg, read_recorded_meta(place.local), device, _bf16_only(cfg, device))
    run_cfg, length_note = fit_to_positions(run_cfg, text_config(info.config).get("max_position_embeddings"))
    meta = build_meta(cfg, info, layer_ids, world, run_cfg.compute_dtype)  # type: ignore[arg-type]  # settled
    existed, created = Path(place.local).exists(), not (Path(place.local) / layout.CACHE_META).exists()
    # A new cache is stamped (cache.json: compute dtype, ...) only once its backend has started, so a failed start
    # (no CUDA, vLLM missing, ...) leaves nothing that would refuse or change the corrected command.
    if cfg.backend == "vllm":  # vLLM's own output: OUTPUT/vllm.log, a temporary file until the output exists
        vllm_log.route_to(place.local if place.remote is None and Path(place.local).is_dir() else None)
    backend = _start_new(run_cfg, Path(place.local), meta) if created else None
    root, writer = _open_store(cfg, meta, place, rank, world, backend, tokenizer_facts(renderer.tokenizer))
    summary = ExtractSummary(output=cfg.output if place.remote is not None else str(root), store=writer.store)
    note = collapsed_layers_note(cfg, info.num_hidden_layers)
    summary.notes += [n for n in (note, length_note) if n] + split_notes(cfg.data, cfg.split)
    if writer.complete:
        return _already_complete(cfg, summary, writer, backend, place.remote, world)
    summary.compute_dtype = f"{why}; stored hidden states {cfg.dtype}"
    log.info("%s", summary.compute_dtype)
    start = time.perf_counter()
    undo = (lambda: _remove_new(root, existed, place)) if created else None
    _write_store(run_cfg, meta, writer, renderer, rank, world, summary, backend, undo)
    summary.elapsed_s = time.perf_counter() - start
    return _unstage(_finish(summary, writer, already=False), place.remote, writer)


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
    cfg: ExtractConfig,
    meta: CacheMeta,
    place: _Place,
    rank: int,
    world: int,
    backend: TargetBackend | None,
    facts: TokenizerFacts,
) -> tuple[Path, CacheWriter]:
    """Create or check the cache (pushed to the object store, if any; a new one keeps the tokenizer's `facts`) and
    open this rank's writer; a started `backend` is closed if that fails."""
    try:
        root = prepare_output(cfg, meta, root=place.local, tokenizer_facts=facts)
        if place.remote is not None:
            place.remote.push_root(meta)
        return root, CacheWriter(root, meta, rank, world, remote=place.remote).open()
    except BaseException as err:
        if backend is not None:
            backend.close()
        if isinstance(err, OSError):
            raise_if_unwritable(err, cfg.output)
        raise


def _already_complete(
    cfg: ExtractConfig,
    summary: ExtractSummary,
    writer: CacheWriter,
    backend: TargetBackend | None,
    remote: RemoteCache | None,
    world: int,
) -> ExtractSummary:
    """The summary of a store an earlier run finished (nothing to compute; a started `backend` is closed)."""
    writer.abort()
    if backend is not None:
        backend.close()
    if writer.committed_samples == 0 and world == 1:  # written by a version that allowed it
        raise BadInput(f"{_no_samples(cfg, writer)}; remove {cfg.output} and re-run with usable data")
    return _unstage(_finish(summary, writer, already=True), remote, writer)


def _write_store(
    cfg: ExtractConfig,
    meta: CacheMeta,
    writer: CacheWriter,
    renderer: Any,
    rank: int,
    world: int,
    summary: ExtractSummary,
    backend: TargetBackend | None,
    undo: Callable[[], None] | None,
) -> None:
    """Compute and commit this rank's store (its new tokens into `summary`), then close the backend.

    `undo` (a new cache only) removes the cache when this (only) rank has no usable sample.
    """
    try:
        backend, summary.new_tokens = _loop(
            cfg, meta, writer, renderer, rank, world, summary.compute_dtype, backend
        )
        if writer.next_ordinal == 0 and world == 1:  # (one of several ranks may legitimately get none)
            raise _NoSamples(_no_samples(cfg, writer))  # the store is never committed: a re-run starts afresh
        writer.close()
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM (preemption): the committed shards stay
        writer.abort()
        raise stop_error(
            stop,
            f": {writer.committed_samples} samples of {writer.store} are committed; re-run the same command to resume",
        ) from None
    except _NoSamples as err:
        writer.abort()
        if undo is not None:  # nothing else is in it: leave the output as it was before this call
            undo()
        raise BadInput(str(err)) from None
    except OSError as err:  # (disk full is already OutOfSpace, raised by the writer)
        writer.abort()
        raise_if_unwritable(err, cfg.output)
    except BaseException:
        writer.abort()
        raise
    finally:
        if backend is not None:
            backend.close()


def _remove_new(root: Path, existed: bool, place: _Place) -> None:
    """Remove a cache this call created (and its object-store root, if this call put it there)."""
    remove_new_cache(root, existed)
    if place.remote is not None and not place.remote_had:
        place.remote.remove_root()


def _start_new(cfg: ExtractConfig, root: Path, meta: CacheMeta) -> TargetBackend:
    """The backend of a new cache, started before anything is written; the output directory is checked first
    (a foreign directory is refused before a slow start).

    Raises:
        OutputExists, BadConfig (vLLM missing), and whatever the backend's start raises (BadInput: no CUDA, ...).
    """
    check_output_dir(root, layout.CACHE_META, "a peagle cache")
    return get_backend(cfg.backend, backend_settings(cfg), list(meta.aux_layer_ids))


def _unstage(summary: ExtractSummary, remote: RemoteCache | None, writer: CacheWriter) -> ExtractSummary:
    """Drop the staging copy of a finished store written to an object store (the object store holds it)."""
    if remote is not None:
        shutil.rmtree(writer.store_dir, ignore_errors=True)
    return summary


class _NoSamples(Exception):
    """This (only) rank produced no usable sample: reported as BadInput once the new cache is removed."""


def _no_samples(cfg: ExtractConfig, writer: CacheWriter) -> str:
    """The error for a store without a single usable sample, naming the most frequent reject reasons."""
    from peagle_pipeline.data.records import most_common_reasons

    data = ", ".join(cfg.data)
    if not writer.num_rejects:
        return f"no usable samples: {data} holds no rows; nothing was written"
    top = most_common_reasons(r["reason"] for r in writer.rejects)
    return f"no usable samples in {data}: all {writer.num_rejects} rows were rejected ({top}); nothing was written"


def _loop(
    cfg: ExtractConfig,
    meta: CacheMeta,
    writer: CacheWriter,
    renderer: Any,
    rank: int,
    world: int,
    banner: str = "",
    backend: TargetBackend | None = None,
) -> tuple[TargetBackend | None, int]:
    """The batch loop; returns the backend (`backend`, or one it started) and the tokens computed this run.

    `banner` is written once above the progress bar (the compute dtype line)."""
    from tqdm import tqdm

    from peagle_pipeline.data.formats import iter_rows

    total = sum(1 for _ in rank_rows(iter_rows(cfg.data, cfg.split), rank, world, cfg.max_samples))
    rows = rank_rows(iter_rows(cfg.data, cfg.split), rank, world, cfg.max_samples)
    samples = sort_by_length(render_rows(rows, renderer, cfg.max_length, cfg.overlong), meta.length_window)
    items = plan_batches(samples, cfg.batch_tokens)
    t0 = last_line = time.perf_counter()
    done = 0
    # no terminal (a pipe, SLURM, nohup): a plain line after a batch, at most every LINE_EVERY_S, instead of a bar
    # (TQDM_DISABLE=1 turns both off)
    bar = tqdm(
        total=total, unit="sample", desc=writer.store, mininterval=1.0, dynamic_ncols=True, disable=None
    )
    plain = bar.disable and os.environ.get("TQDM_DISABLE", "").lower() in ("", "0", "false")

    def advance(n: int) -> None:
        nonlocal done, last_line
        bar.update(n)
        done += n
        now = time.perf_counter()
        if plain and (now - last_line >= LINE_EVERY_S or done == total):
            last_line = now
            rate = ahead.new_tokens / max(now - t0, 1e-9)
            print(f"{writer.store}: {done}/{total} samples, {rate:.0f} tokens/s", file=sys.stderr, flush=True)

    with bar:
        if banner and not bar.disable:  # with the bar only: a failing command prints one line on stderr
            bar.write(banner, file=sys.stderr)
        ahead = BatchPipeline(writer, meta, advance)
        for item in items:
            if isinstance(item, RowReject):
                ahead.reject(item)
                continue
            if item[-1].ordinal < writer.next_ordinal:  # committed by an earlier run
                advance(len(item))
                continue
            if backend is None:
                backend = get_backend(cfg.backend, backend_settings(cfg), list(meta.aux_layer_ids))
            ahead.submit(backend, item)
            rate = ahead.new_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
        ahead.drain()
    return backend, ahead.new_tokens


def _finish(summary: ExtractSummary, writer: CacheWriter, already: bool) -> ExtractSummary:
    summary.already_complete = already
    summary.samples = writer.committed_samples
    summary.tokens = writer.committed_tokens
    summary.supervised = writer.committed_supervised
    summary.rejects = dict(collections.Counter(r["reason"] for r in writer.rejects))
    summary.store_bytes = sum(f.stat().st_size for f in writer.store_dir.rglob("*") if f.is_file())
    return summary
