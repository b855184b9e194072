"""Extraction runner: this rank's rows -> chat rendering -> deterministic batches -> target backend -> CacheWriter.

Resuming is exact because the batch plan is a pure function of the rank's row sequence and the settings: a
resumed run re-forms the same batches, skips those whose samples are all committed, recomputes the batch that
holds the first uncommitted sample, and the writer drops tokens it already has. Never decides storage layout
(that is `cache/`) and never branches on the backend name.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, NoReturn

import numpy as np

from peagle_pipeline.backends import vllm_log
from peagle_pipeline.backends.base import (
    DEFAULT_LAYER_RULE,
    BackendSettings,
    SampleOutputs,
    TargetBackend,
    default_layer_ids,
    spelled_default_layer_ids,
    submit,
)
from peagle_pipeline.backends.registry import get_backend
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.location import (
    compute_dtype_in,
    length_window_in,
    prepare_cache,
    read_recorded_meta,
    remove_new_cache,
)
from peagle_pipeline.cache.remote import RemoteCache, is_remote
from peagle_pipeline.cache.target import TargetSource
from peagle_pipeline.cache.writer import CacheWriter, SampleData, SampleRecord
from peagle_pipeline.config import ExtractConfig, to_dict
from peagle_pipeline.core.target_init import target_init_layer
from peagle_pipeline.errors import (
    BadInput,
)
from peagle_pipeline.preemption import stop_error
from peagle_pipeline.runtime import (
    check_output_dir,
    describe_compute_dtype,
    resolve_compute_dtype,
    writer_rank,
)

__all__ = [
    "run",
    "ExtractSummary",
    "PlannedSample",
    "RowReject",
    "plan_batches",
    "build_meta",
    "prepare_output",
    "target_source",
    "settle_auto",
    "Settled",
    "backend_settings",
    "target_device",
    "forward_dtype",
    "BatchPipeline",
]

log = logging.getLogger(__name__)

LINE_EVERY_S = 10.0  # plain progress lines (no terminal): at most one per this many seconds


@dataclass(frozen=True, slots=True)
class PlannedSample:
    """A rendered sample at storage position `ordinal` of this rank's store."""

    ordinal: int
    record: SampleRecord
    input_ids: list[int]
    loss_mask: list[bool]


@dataclass(frozen=True, slots=True)
class RowReject:
    """A row of this rank that yields no sample, with the reason."""

    sample_id: int
    source: str
    source_row: int
    reason: str


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


# ---------------------------------------------------------------------------------------------- planning
def rank_rows(
    rows: Iterable[Any], rank: int, world_size: int, max_samples: int | None
) -> Iterator[tuple[int, Any]]:
    """(global row index = sample id, row) for this rank: the first max_samples rows, then index % world == rank."""
    for index, row in enumerate(rows):
        if max_samples is not None and index >= max_samples:
            return
        if index % world_size == rank:
            yield index, row


def render_rows(
    rows: Iterable[tuple[int, Any]], renderer: Any, max_length: int, overlong: str
) -> Iterator[PlannedSample | RowReject]:
    """Rendered samples (numbered 0, 1, ... in storage order) and rejects, in row order."""
    from peagle_pipeline.data.chat import RejectRow
    from peagle_pipeline.data.records import Reject, TokenizedConversation

    ordinal = 0
    for index, row in rows:
        if isinstance(row, Reject):
            yield RowReject(index, row.source, row.source_row, row.reason)
            continue
        try:  # on-policy rows carry their generated ids: used as they are, never re-rendered
            if isinstance(row, TokenizedConversation):
                rendered = renderer.check_tokens(row.input_ids, row.loss_mask)
            else:
                # only max_length tokens are kept (+1 tells an overlong sample): a huge row is not tokenised whole
                rendered = renderer.render(row.messages, max_tokens=max_length + 1)
        except RejectRow as err:
            yield RowReject(index, row.source, row.source_row, err.reason)
            continue
        ids, mask = list(rendered.input_ids), list(rendered.loss_mask)
        truncated = len(ids) > max_length
        if truncated:
            if overlong == "skip":
                yield RowReject(index, row.source, row.source_row, f"longer than max_length {max_length}")
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask):
                yield RowReject(index, row.source, row.source_row, "no supervised tokens within max_length")
                continue
        if len(ids) < 2:
            yield RowReject(index, row.source, row.source_row, "shorter than 2 tokens")
            continue
        yield PlannedSample(ordinal, SampleRecord(index, row.source, row.source_row, truncated), ids, mask)
        ordinal += 1


# `length_window` of a new cache: samples sorted by length together in windows of this many (`sort_by_length`).
DEFAULT_LENGTH_WINDOW = 256


def sort_by_length(
    items: Iterable[PlannedSample | RowReject], window: int
) -> Iterator[PlannedSample | RowReject]:
    """Each window of `window` consecutive samples stably sorted by length, its storage positions renumbered in
    that order (a sample keeps its row index as `sample_id`); rejects pass through as soon as they are seen.

    Batches pad every sample to the batch's longest, and on-policy data alternates short and long rows: in row
    order, batches of `make quality`'s on-policy caches computed 1.7x their real tokens (2.2x in attention); sorted
    in windows of 256 (`DEFAULT_LENGTH_WINDOW`), 1.04x.

    Deterministic given the rows, so a resumed run plans the same storage order. Example: lengths [5, 2, 9, 2] at
    positions 0..3 with window 4 -> positions 0..3 hold the samples of lengths [2, 2, 5, 9] (rows 1, 3, 0, 2).
    """
    pending: list[PlannedSample] = []

    def flush() -> Iterator[PlannedSample]:
        first = pending[0].ordinal  # a window's positions are consecutive
        for i, sample in enumerate(sorted(pending, key=lambda s: len(s.input_ids))):
            yield dataclasses.replace(sample, ordinal=first + i)

    for item in items:
        if isinstance(item, RowReject):
            yield item
            continue
        pending.append(item)
        if len(pending) == window:
            yield from flush()
            pending = []
    if pending:
        yield from flush()


def plan_batches(
    items: Iterable[PlannedSample | RowReject], batch_tokens: int
) -> Iterator[RowReject | list[PlannedSample]]:
    """Group samples greedily, in order, so that (longest sample) x (batch size) <= batch_tokens.

    Rejects pass through as soon as they are seen; a sample longer than batch_tokens forms its own batch.
    Example: lengths [300, 500, 200, 900], batch_tokens 1024 -> [300, 500] (pads to 2 x 500 = 1000), then 200
    would pad to 3 x 500 = 1500 > 1024 so it starts [200], and 900 would make 2 x 900 = 1800 -> [900] alone.
    """
    batch: list[PlannedSample] = []
    longest = 0
    for item in items:
        if isinstance(item, RowReject):
            yield item
            continue
        n = len(item.input_ids)
        if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(item)
        longest = max(longest, n)
    if batch:
        yield batch


# ------------------------------------------------------------------------------------------ output dir
_LOGICAL: dict[Literal["bf16", "fp32", "fp8"], str] = {
    "bf16": "bfloat16",
    "fp32": "float32",
    "fp8": layout.FP8,
}


def build_meta(
    cfg: ExtractConfig,
    info: Any,
    layer_ids: list[int],
    world_size: int,
    compute_dtype: Literal["bf16", "fp32"] | None = None,
) -> CacheMeta:
    """The cache metadata for these settings (compared field by field on resume).

    `compute_dtype` ("bf16"/"fp32") is the resolved forward dtype; None resolves it for this machine.
    """
    from peagle_pipeline import __version__, model_dir
    from peagle_pipeline.data.formats import dataset_fingerprint

    if compute_dtype is None:
        compute_dtype = forward_dtype(cfg, target_device(cfg))

    return CacheMeta(
        target_name_or_path=str(Path(cfg.model).resolve()),
        target_architectures=list(info.architectures),
        target_config_sha256=model_dir.config_sha256(cfg.model),
        tokenizer_sha256=model_dir.tokenizer_sha256(cfg.model),
        chat_template_sha256=model_dir.chat_template_sha256(cfg.model),
        num_hidden_layers=info.num_hidden_layers,
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        aux_layer_ids=list(layer_ids),
        topk=cfg.topk,
        hidden_dtype=_LOGICAL[cfg.dtype],
        compute_dtype=_LOGICAL[compute_dtype],
        has_last_hidden=cfg.last_hidden,
        max_length=cfg.max_length,
        overlong=cfg.overlong,
        assistant_turns=cfg.assistant_turns,
        leading_assistant=cfg.leading_assistant,
        dataset_fingerprint=dataset_fingerprint(cfg.data, cfg.split),
        max_samples=cfg.max_samples,
        world_size=world_size,
        shard_tokens=cfg.shard_tokens,
        chunk_tokens=cfg.chunk_tokens,
        compress=cfg.compress,
        length_window=cfg.length_window or DEFAULT_LENGTH_WINDOW,
        extra={"backend": cfg.backend, "peagle_pipeline_version": __version__},
    )


def target_device(cfg: ExtractConfig) -> str:
    """The device the target runs on, as a string: `auto` -> "cuda" when CUDA is available, else "cpu"."""
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def forward_dtype(cfg: ExtractConfig, device: str) -> Literal["bf16", "fp32"]:
    """The dtype of the target forward: `cfg.compute_dtype`, where auto means fp32 when the stored dtype is fp32
    (a bf16 forward stored in fp32 only costs space), else the hardware's choice (`resolve_compute_dtype`)."""
    if cfg.compute_dtype == "auto" and cfg.dtype == "fp32":
        return "fp32"
    return resolve_compute_dtype(cfg.compute_dtype, device)


def backend_settings(cfg: ExtractConfig) -> BackendSettings:
    """The target backend's own settings from the extract section (the forward dtype resolved)."""
    return BackendSettings(
        model=cfg.model,
        compute_dtype=forward_dtype(cfg, target_device(cfg)),
        topk=cfg.topk,
        last_hidden=cfg.last_hidden,
        device=cfg.device,
        topk_chunk=cfg.topk_chunk,
        max_length=cfg.max_length,
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
    )


class Settled(NamedTuple):
    """The settings of one extract run with their "auto" values settled (`settle_auto`)."""

    cfg: ExtractConfig
    """As recorded (extract.yaml, cache.json): length_window settled; compute_dtype as given."""
    run_cfg: ExtractConfig
    """What the backend runs: `cfg` with compute_dtype settled too (the dtype cache.json records)."""
    why: str
    """The line that says which compute dtype and why."""


_COMPUTED: dict[str, Literal["bf16", "fp32"]] = {"bfloat16": "bf16", "float32": "fp32"}


def settle_auto(cfg: ExtractConfig, recorded: dict[str, Any] | None, device: str) -> Settled:
    """Settle the "auto" values of `cfg` from the cache being resumed (`recorded`: its cache.json as read once,
    None for a new cache) and the device the target runs on. Reads nothing itself.

    Under `compute_dtype: auto` a cache that already exists keeps the forward dtype it was started with (one cache
    never mixes bf16 and fp32 forwards, whichever machine resumes it or writes another rank); otherwise
    `forward_dtype` decides from the stored dtype and the hardware. An explicit setting is used as given (and
    refused by `prepare_output` if the cache recorded another). An unset length_window keeps the resumed cache's
    storage order, else takes DEFAULT_LENGTH_WINDOW.
    """
    chosen = forward_dtype(cfg, device)
    kept = _COMPUTED.get(compute_dtype_in(recorded) or "") if cfg.compute_dtype == "auto" else None
    if kept is not None:
        line = describe_compute_dtype("auto", device, kept)
        compute, why = kept, line[: line.index(" (")] + " (auto: kept from the cache being resumed)"
    elif cfg.compute_dtype == "auto" and cfg.dtype == "fp32":
        compute, why = chosen, f"compute dtype fp32 on {device} (auto: dtype is fp32)"
    else:
        compute, why = chosen, describe_compute_dtype(cfg.compute_dtype, device, chosen)
    window = cfg.length_window or length_window_in(recorded) or DEFAULT_LENGTH_WINDOW
    settled = dataclasses.replace(cfg, length_window=window)
    return Settled(settled, dataclasses.replace(settled, compute_dtype=compute), why)


def target_source(model: str, init_layer: int | None = None) -> TargetSource:
    """Where a cache's target/ comes from: the model's config and tokenizer files, and its pieces (read from its
    safetensors only when target/ is written), with decoder layer `init_layer` for the draft's initialisation.

    Raises:
        BadInput: missing model directory or config.json.
    """
    from peagle_pipeline import model_dir

    return TargetSource(
        source=str(Path(model)),
        files=tuple(model_dir.target_files(model)),
        load_pieces=lambda: model_dir.load_target_pieces_from_model(model, init_layer),
        init_layer=init_layer,
    )


def prepare_output(cfg: ExtractConfig, meta: CacheMeta, root: str | None = None) -> Path:
    """Create or check the cache directory at cfg.output, or at `root` (an object store's staging directory)
    (`cache.location.prepare_cache`).

    Raises:
        OutputExists, IncompatibleCache, ResumeMismatch: see `prepare_cache`.
    """
    import yaml

    settings = yaml.safe_dump({"extract": to_dict(cfg)}, sort_keys=False)
    init_layer = target_init_layer(meta.num_hidden_layers)
    return prepare_cache(root or cfg.output, meta, settings, target_source(cfg.model, init_layer))


# ------------------------------------------------------------------------------------------------- run
def to_sample_data(sample: PlannedSample, out: SampleOutputs, meta: CacheMeta) -> SampleData:
    """Backend outputs [T, ...] -> stored dtypes (bf16 bits as uint16, int32 ids, float16 log-probs)."""
    T = len(sample.input_ids)
    if out.aux_hidden.shape[0] != T or out.topk_ids.shape != (T, meta.topk):
        raise RuntimeError(
            f"backend returned shapes {tuple(out.aux_hidden.shape)}/{tuple(out.topk_ids.shape)} "
            f"for a sample of {T} tokens"
        )
    return SampleData(
        input_ids=np.asarray(sample.input_ids, dtype=np.int32),
        loss_mask=np.asarray(sample.loss_mask, dtype=bool),
        aux_hidden=layout.to_storage(out.aux_hidden, meta.hidden_dtype),
        topk_ids=out.topk_ids.detach().to("cpu").to(dtype=_torch().int32).numpy(),
        topk_logprobs=out.topk_logprobs.detach().to("cpu").float().numpy().astype(np.float16),
        last_hidden=layout.to_storage(out.last_hidden, meta.hidden_dtype) if meta.has_last_hidden else None,
    )


def _torch() -> Any:
    import torch

    return torch


def resolve_layers(cfg: ExtractConfig, num_hidden_layers: int) -> list[int]:
    """Aux layer ids, ascending; BadInput when outside 0..L."""
    ids = sorted(set(cfg.layers)) if cfg.layers else default_layer_ids(num_hidden_layers)
    bad = [i for i in ids if not 0 <= i <= num_hidden_layers]
    if bad:
        raise BadInput(
            f"layer ids {bad} outside 0..{num_hidden_layers} (the target has {num_hidden_layers} layers)"
        )
    return ids


def collapsed_layers_note(cfg: ExtractConfig, num_hidden_layers: int) -> str | None:
    """On small targets the default ids [2, L//2, L-3] coincide (L=6: [2, 3, 3]); the draft then gets fewer aux
    hidden states than the usual 3. Not an error (tiny test models rely on it), but the user should know."""
    L = num_hidden_layers
    spelled = spelled_default_layer_ids(L)
    ids = default_layer_ids(L)
    if cfg.layers or len(ids) == len(spelled):
        return None
    return (
        f"the default aux layers {DEFAULT_LAYER_RULE} of this {L}-layer target are {spelled}: the draft gets "
        f"{len(ids)} aux hidden states instead of 3; pass --layers to choose 3 distinct ids"
    )


def run(cfg: ExtractConfig) -> ExtractSummary:
    """Extract (or resume) this rank's store of the cache at cfg.output. See the module docstring.

    Raises:
        BadInput, BadConfig, OutputExists, IncompatibleCache, ResumeMismatch, Busy, OutOfSpace, Interrupted (Ctrl-C), Terminated (SIGTERM).
    """
    from peagle_pipeline.model_dir import load_tokenizer, read_target_info

    rank, world = writer_rank(cfg.rank, cfg.world_size)
    info = read_target_info(cfg.model)
    layer_ids = resolve_layers(cfg, info.num_hidden_layers)
    if cfg.topk > info.vocab_size:
        raise BadInput(f"topk {cfg.topk} exceeds the target vocabulary ({info.vocab_size})")
    from peagle_pipeline.data.chat import ChatRenderer
    from peagle_pipeline.data.formats import iter_rows, split_notes

    # Checked before the output exists: bad data paths or tokenizer must not leave a cache stamped with them.
    iter_rows(cfg.data, cfg.split)  # checks every path's existence and kind; reads nothing
    tokenizer = load_tokenizer(cfg.model)
    renderer = ChatRenderer(tokenizer, cfg.assistant_turns, cfg.leading_assistant)
    # An object store is written through a local staging directory holding what the writer needs of it.
    remote = RemoteCache(cfg.output) if is_remote(cfg.output) else None
    local = str(remote.staging) if remote is not None else cfg.output
    remote_had = remote.pull_root() if remote is not None else False
    cfg, run_cfg, why = settle_auto(cfg, read_recorded_meta(local), target_device(cfg))
    meta = build_meta(cfg, info, layer_ids, world, run_cfg.compute_dtype)  # type: ignore[arg-type]  # settled
    existed, created = Path(local).exists(), not (Path(local) / layout.CACHE_META).exists()
    # A new cache is stamped (cache.json: compute dtype, ...) only once its backend has started, so a failed start
    # (no CUDA, vLLM missing, ...) leaves nothing that would refuse or change the corrected command.
    if cfg.backend == "vllm":  # vLLM's own output: OUTPUT/vllm.log, a temporary file until the output exists
        vllm_log.route_to(local if remote is None and Path(local).is_dir() else None)
    backend = _start_new(run_cfg, Path(local), meta) if created else None
    try:
        root = prepare_output(cfg, meta, root=local)
        if remote is not None:
            remote.push_root(meta)
        writer = CacheWriter(root, meta, rank, world, remote=remote).open()
    except BaseException as err:
        if backend is not None:
            backend.close()
        if isinstance(err, OSError):
            raise_if_unwritable(err, cfg.output)
        raise
    summary = ExtractSummary(output=cfg.output if remote is not None else str(root), store=writer.store)
    note = collapsed_layers_note(cfg, info.num_hidden_layers)
    summary.notes += ([note] if note else []) + split_notes(cfg.data, cfg.split)
    if writer.complete:
        writer.abort()
        if backend is not None:
            backend.close()
        if writer.committed_samples == 0 and world == 1:  # written by a version that allowed it
            raise BadInput(f"{_no_samples(cfg, writer)}; remove {cfg.output} and re-run with usable data")
        return _unstage(_finish(summary, writer, already=True), remote, writer)
    summary.compute_dtype = f"{why}; stored hidden states {cfg.dtype}"
    log.info("%s", summary.compute_dtype)
    start = time.perf_counter()
    try:
        backend, summary.new_tokens = _loop(
            run_cfg, meta, writer, renderer, rank, world, summary.compute_dtype, backend
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
        if created:  # nothing else is in it: leave the output as it was before this call
            remove_new_cache(root, existed)
            if remote is not None and not remote_had:
                remote.remove_root()
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
    summary.elapsed_s = time.perf_counter() - start
    return _unstage(_finish(summary, writer, already=False), remote, writer)


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


def raise_if_unwritable(err: OSError, output: str) -> NoReturn:
    """A permission error or read-only file system under the output becomes `BadInput`; anything else re-raises."""
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = f" ({err.filename})" if err.filename else ""
        raise BadInput(
            f"cannot write the cache in {output}: {err.strerror}{where}; choose a writable --output"
        ) from None
    raise err


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


class BatchPipeline:
    """Writes batches one behind the backend: batch i+1 is submitted (on CUDA, queued on the device) before batch
    i's outputs are waited for, converted and added to the writer, so the device never idles while the host writes.

    The writer sees exactly the calls, in exactly the order, of a plain forward-then-write loop: a reject seen
    while a batch is in flight is recorded after that batch's samples, as it would have been.

    Args:
        writer: the store's writer.
        meta: the cache's metadata (stored dtypes).
        progress: called with the number of rows done (samples written, rejects recorded).
    """

    def __init__(self, writer: CacheWriter, meta: CacheMeta, progress: Callable[[int], Any]) -> None:
        self.writer, self.meta, self.progress = writer, meta, progress
        self.new_tokens = 0
        self._pending: tuple[list[PlannedSample], Callable[[], list[SampleOutputs]]] | None = None
        self._held: list[RowReject] = []

    def submit(self, backend: TargetBackend, batch: list[PlannedSample]) -> None:
        """Start `batch` on the backend, then write the batch before it."""
        collect = submit(backend, [s.input_ids for s in batch])
        self.drain()
        self._pending = (batch, collect)

    def reject(self, item: RowReject) -> None:
        """Record a rejected row (after the batch in flight, if any)."""
        if self._pending is not None:
            self._held.append(item)
            return
        self.writer.add_reject(item.sample_id, item.source, item.source_row, item.reason)
        self.progress(1)

    def drain(self) -> None:
        """Wait for the batch in flight, write it, then the rejects held behind it."""
        if self._pending is not None:
            batch, collect = self._pending
            self._pending = None
            for sample, out in zip(batch, collect(), strict=True):
                self.writer.add(sample.ordinal, sample.record, to_sample_data(sample, out, self.meta))
            self.new_tokens += sum(len(s.input_ids) for s in batch)
            self.progress(len(batch))
        held, self._held = self._held, []
        for item in held:
            self.reject(item)


def _finish(summary: ExtractSummary, writer: CacheWriter, already: bool) -> ExtractSummary:
    summary.already_complete = already
    summary.samples = writer.committed_samples
    summary.tokens = writer.committed_tokens
    summary.supervised = writer.committed_supervised
    summary.rejects = dict(collections.Counter(r["reason"] for r in writer.rejects))
    summary.store_bytes = sum(f.stat().st_size for f in writer.store_dir.rglob("*") if f.is_file())
    return summary
