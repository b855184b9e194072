"""CacheWriter: the only code that writes a cache store. One writer per rank, one Zarr v3 store per writer.

Commit protocol (crash-safe, resumable to the bit):
  1. whole shards of every array are written (the last partial shard only at `close()`), then fsynced;
  2. the store's tables (`samples.parquet`, `rejects.parquet`, `token_counts.npy`) are replaced atomically;
  3. `manifest.json` is replaced atomically, LAST. It names the committed tokens and samples, the checksum of
     every array's rows in every shard and of every table, and `complete` after a clean close.
With a `RemoteCache` (an object store; `root` is then its local staging directory) each commit is uploaded after
step 3, the manifest last (`cache/remote.py`), and `open` fetches the store from the object store first.
Anything the manifest does not name is garbage, overwritten by the next run. Never reads user data, never
runs models; the runner (`stages/extract/stage.py`) feeds it samples in storage order. The arrays are
`store_arrays.py`'s (create, reopen, write, fsync), the tables and manifest of steps 2 and 3 `commit.py`'s.

Test hook: PEAGLE_TEST_COMMIT_SLEEP=<seconds> sleeps between writing a commit's shard data and its tables and
manifest, so crash tests can kill -9 a writer inside that window. Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.commit import (
    commit_files,
    read_manifest,
    table_blobs,
    write_manifest,
    write_tables,
)
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.remote import RemoteCache
from peagle_pipeline.cache.store_arrays import (
    create_arrays,
    fsync_shards,
    open_arrays,
    shard_checksums,
    write_rows,
)
from peagle_pipeline.errors import IncompatibleCache, ResumeMismatch
from peagle_pipeline.preemption import deferred
from peagle_pipeline.runtime import RankLock, pause_for_crash_test, raise_if_no_space

__all__ = ["SampleRecord", "SampleData", "CacheWriter"]

log = logging.getLogger(__name__)

SLEEP_ENV = "PEAGLE_TEST_COMMIT_SLEEP"  # the crash-test hook of the module docstring


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """Identity of one sample: its global row index (= sample id), source file and row there."""

    sample_id: int
    source: str
    source_row: int
    truncated: bool = False


@dataclass(slots=True)
class SampleData:
    """One sample's arrays in stored dtypes, row t = position t (unshifted).

    Attributes:
        input_ids: int32 [T]; loss_mask: bool [T];
        aux_hidden: uint16 [T, n_aux, H] (bf16 bits) or float32; topk_ids: int32 [T, k];
        topk_logprobs: float16 [T, k]; last_hidden: [T, H] like aux_hidden, or None.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    aux_hidden: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    last_hidden: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class _Pending:
    """A sample added but not yet fully inside committed shards (kept for its token counts)."""

    row: dict[str, Any]
    counted_ids: np.ndarray  # int64 [n_supervised]: supervised token ids, counted on commit
    all_ids: np.ndarray  # int64 [T]: every token id of the sample, counted on commit


class CacheWriter:
    """Writes one rank's store under `root/stores/`, committing whole shards; resumes from the manifest.

    Usage (the runner feeds samples in storage order, ordinal 0, 1, 2, ...):
        w = CacheWriter(root, meta, rank, world).open()
        for ordinal, (record, data) in enumerate(samples):
            if ordinal >= w.committed_samples: w.add(ordinal, record, data)   # earlier ones are dropped anyway
        w.close()

    Raises (from `open`): Busy (another live writer of this rank), IncompatibleCache (other format version),
    ResumeMismatch (the store was written with other settings).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        meta: CacheMeta,
        rank: int,
        world_size: int,
        remote: RemoteCache | None = None,
    ) -> None:
        self.root = Path(root)
        self._remote = remote  # an object store mirrored after every commit (root is then its staging dir)
        self.meta = meta
        self.rank = rank
        self.world_size = world_size
        self.store = layout.store_name(rank, world_size)
        self.store_dir = self.root / layout.STORES_DIR / self.store
        self.specs = layout.array_specs(meta)
        self.shard_tokens = meta.shard_tokens
        self._lock = RankLock(
            self.root / layout.STORES_DIR / layout.lock_name(rank, world_size), f"store {self.store}"
        )
        self._arrays: dict[str, Any] = {}
        self._samples: list[dict[str, Any]] = []  # committed rows, storage order
        self._rejects: dict[int, dict[str, Any]] = {}
        self._counts = np.zeros(meta.vocab_size, dtype=np.int64)
        self._all_counts = np.zeros(meta.vocab_size, dtype=np.int64)
        self._shards: list[dict[str, Any]] = []
        self._pending: list[_Pending] = []
        self._buffer: dict[str, list[np.ndarray]] = {}
        self._buffered = 0
        self.committed_tokens = 0  # end of the committed token range (a multiple of shard_tokens until close)
        self.committed_samples = 0
        self.complete = False
        self._next_ordinal = 0
        self._next_offset = 0
        self._commits = 0
        self._new_shards: list[int] = []  # shard indices written by the commit in progress (uploaded with it)

    # ----------------------------------------------------------------------------------------------- open
    def open(self) -> CacheWriter:
        """Lock the rank, then create the store or load its committed state (garbage past it is ignored)."""
        if self._remote is None:  # a damaged manifest is reported before anything (the lock) is touched
            read_manifest(self.store_dir)
        self._lock.acquire()
        try:
            if self._remote is not None:  # the object store's copy is the truth: lock it, then fetch it
                self._remote.lock(self.store, layout.lock_name(self.rank, self.world_size))
                self._remote.pull_store(self.store)
            self._open_store()
        except BaseException:
            self._release()
            raise
        return self

    def _release(self) -> None:
        try:
            if self._remote is not None:
                self._remote.unlock()
        finally:
            self._lock.release()

    def _open_store(self) -> None:
        manifest = read_manifest(self.store_dir)
        if manifest is None:
            if self.store_dir.exists():  # a run died before its first commit: nothing in it counts
                shutil.rmtree(self.store_dir)
            self._create_store()
            return
        if manifest.get("format_version") != layout.FORMAT_VERSION:
            raise IncompatibleCache(
                f"store {self.store} has format version {manifest.get('format_version')}, this peagle-pipeline "
                f"writes {layout.FORMAT_VERSION}: use a new output directory"
            )
        diffs = CacheMeta.from_dict(manifest["meta"]).differences(self.meta)
        if diffs:
            raise ResumeMismatch(f"store {self.store} was written with other settings: {', '.join(diffs)}")
        self._arrays = open_arrays(self.store_dir, self.specs)
        self.committed_tokens = int(manifest["committed_tokens"])
        self.committed_samples = int(manifest["committed_samples"])
        self.complete = bool(manifest["complete"])
        self._shards = list(manifest["shards"])
        self._commits = int(manifest.get("commits", 0))
        self._load_tables(manifest)
        last = self._samples[-1] if self._samples else None
        self._next_ordinal = self.committed_samples
        self._next_offset = int(last["offset"] + last["length"]) if last else 0

    def _create_store(self) -> None:
        self._arrays = create_arrays(self.store_dir, self.meta, self.specs, self.rank, self.world_size)

    def _load_tables(self, manifest: dict[str, Any]) -> None:
        import pandas as pd

        samples = pd.read_parquet(self.store_dir / layout.SAMPLES_TABLE)
        # The table may be ahead of the manifest (killed between the two writes): keep the committed prefix.
        self._samples = samples.iloc[: self.committed_samples].to_dict("records")
        if len(self._samples) != self.committed_samples:
            raise IncompatibleCache(
                f"store {self.store}: samples table shorter than its manifest; "
                "delete the store directory to redo this rank"
            )
        rejects_path = self.store_dir / layout.REJECTS_TABLE
        if rejects_path.exists():
            for row in pd.read_parquet(rejects_path).to_dict("records"):
                self._rejects[int(row["sample_id"])] = row
        self._counts = self._load_counts(manifest, layout.TOKEN_COUNTS, supervised_only=True)
        self._all_counts = self._load_counts(manifest, layout.ALL_TOKEN_COUNTS, supervised_only=False)

    def _load_counts(self, manifest: dict[str, Any], table: str, supervised_only: bool) -> np.ndarray:
        """A committed counts table, or a recount from the arrays when it was written after the last manifest
        (or by a version that did not write it)."""
        path = self.store_dir / table
        raw = path.read_bytes() if path.exists() else b""
        if layout.file_hash(raw) == manifest["tables"].get(table):
            return np.load(io.BytesIO(raw)).astype(np.int64)
        return self._recount(supervised_only)

    def _recount(self, supervised_only: bool) -> np.ndarray:
        counts = np.zeros(self.meta.vocab_size, dtype=np.int64)
        if self.committed_tokens:
            end = self._samples[-1]["offset"] + self._samples[-1]["length"] if self._samples else 0
            ids = self._arrays["input_ids"][:end]
            if supervised_only:
                ids = ids[self._arrays["loss_mask"][:end]]
            counts += np.bincount(ids, minlength=self.meta.vocab_size)
        return counts

    # ------------------------------------------------------------------------------------------------ add
    def add_reject(self, sample_id: int, source: str, source_row: int, reason: str) -> None:
        """Record a rejected row (idempotent: a resumed run reports the same rows again)."""
        self._rejects[sample_id] = {
            "sample_id": sample_id,
            "source": source,
            "source_row": source_row,
            "store": self.store,
            "reason": reason,
        }

    def add(self, ordinal: int, record: SampleRecord, data: SampleData) -> None:
        """Append the sample at storage position `ordinal` (0-based over this store's samples).

        Samples before `committed_samples` are already stored and are dropped; a sample straddling the
        committed end has its already-stored leading tokens dropped. Commits whenever a shard fills.
        """
        if self.complete:
            raise RuntimeError("store is complete; nothing may be added")
        if ordinal < self._next_ordinal:
            committed = self._samples[ordinal] if ordinal < len(self._samples) else None
            if committed is not None and int(committed["sample_id"]) != record.sample_id:
                raise ResumeMismatch(
                    f"store {self.store}: sample at position {ordinal} is row {committed['sample_id']} on disk "
                    f"but row {record.sample_id} now; the data or its order changed since the first run"
                )
            return
        if ordinal != self._next_ordinal:
            raise RuntimeError(
                f"samples must arrive in storage order: expected {self._next_ordinal}, got {ordinal}"
            )
        T = len(data)
        self._check_shapes(data)
        offset = self._next_offset
        mask = np.asarray(data.loss_mask, dtype=bool)
        row = {
            "sample_id": record.sample_id,
            "source": record.source,
            "source_row": record.source_row,
            "store": self.store,
            "offset": offset,
            "length": T,
            "num_supervised": int(mask.sum()),
            "truncated": bool(record.truncated),
        }
        all_ids = np.asarray(data.input_ids, dtype=np.int64)
        self._pending.append(_Pending(row, all_ids[mask], all_ids))
        skip = max(0, self.committed_tokens - offset)  # tokens already in committed shards
        if skip < T:
            for name in self.specs:
                arr = getattr(data, name)
                self._buffer.setdefault(name, []).append(arr[skip:])
            self._buffered += T - skip
        self._next_ordinal += 1
        self._next_offset = offset + T
        if self._buffered >= self.shard_tokens:
            self._flush(final=False)

    def _check_shapes(self, data: SampleData) -> None:
        T = len(data)
        for name, (dtype, inner) in self.specs.items():
            arr = getattr(data, name)
            if arr is None or arr.shape != (T, *inner) or arr.dtype != np.dtype(dtype):
                got = None if arr is None else (arr.shape, arr.dtype)
                raise RuntimeError(f"{name}: expected {(T, *inner)} {dtype}, got {got}")

    # ------------------------------------------------------------------------------------------- commit
    def _flush(self, final: bool) -> None:
        """Write the buffered whole shards (and at close the partial tail), then commit; a stop signal waits for it."""
        with deferred():  # a Ctrl-C or SIGTERM acts right after the commit, never inside Zarr's I/O
            self._write_and_commit(final)

    def _write_and_commit(self, final: bool) -> None:
        S = self.shard_tokens
        n = self._buffered if final else (self._buffered // S) * S
        if n == 0 and not final:
            return
        start = self.committed_tokens
        stop = start + n
        self._new_shards = list(range(start // S, (stop - 1) // S + 1)) if n else []
        if n:
            data = {
                name: np.concatenate(parts) if len(parts) > 1 else parts[0]
                for name, parts in self._buffer.items()
            }
            try:
                write_rows(self._arrays, self.specs, data, start, stop)
                fsync_shards(self.store_dir, self.specs, S, start, stop)
            except OSError as err:
                raise_if_no_space(err, f"store {self.store}")
            pause_for_crash_test(SLEEP_ENV)
            self._shards += shard_checksums(data, list(self._arrays), S, start, stop)
            rest = {name: d[n:] for name, d in data.items()}
            self._buffer = {name: [r] for name, r in rest.items()} if self._buffered > n else {}
            self._buffered -= n
        elif final:  # nothing new: drop any garbage a killed run left past the committed end
            for name, arr in self._arrays.items():
                if arr.shape[0] != stop:
                    arr.resize((stop, *self.specs[name][1]))
        self.committed_tokens = stop
        while self._pending and self._pending[0].row["offset"] + self._pending[0].row["length"] <= stop:
            done = self._pending.pop(0)
            self._samples.append(done.row)
            if done.counted_ids.size:
                self._counts += np.bincount(done.counted_ids, minlength=self.meta.vocab_size)
            self._all_counts += np.bincount(done.all_ids, minlength=self.meta.vocab_size)
        self.committed_samples = len(self._samples)
        self._commit(complete=final)

    def _commit(self, complete: bool) -> None:
        try:
            tables = table_blobs(
                self._samples,
                [self._rejects[k] for k in sorted(self._rejects)],
                self._counts,
                self._all_counts,
            )
            write_tables(self.store_dir, tables)
            self._commits += 1
            write_manifest(self.store_dir, self._manifest(complete, tables))
        except OSError as err:
            raise_if_no_space(err, f"store {self.store}")
        if self._remote is not None:
            files = commit_files(self.specs, self._new_shards, tables)
            self._remote.publish(self.store, files, self.committed_samples)
        self.complete = complete

    def _manifest(self, complete: bool, tables: dict[str, bytes]) -> dict[str, Any]:
        """The manifest of the commit in progress (its tables already written: `tables` are their bytes)."""
        return {
            "format_version": layout.FORMAT_VERSION,
            "store": self.store,
            "rank": self.rank,
            "world_size": self.world_size,
            "meta": self.meta.to_dict(),
            "committed_tokens": self.committed_tokens,
            "committed_samples": self.committed_samples,
            "num_rejects": len(self._rejects),
            "complete": complete,
            "commits": self._commits,
            "hash": layout.HASH,
            "shard_tokens": self.shard_tokens,
            "chunk_tokens": self.meta.chunk_tokens,
            "shards": self._shards,
            "tables": {name: layout.file_hash(blob) for name, blob in tables.items()},
        }

    # ------------------------------------------------------------------------------------------- finish
    @property
    def num_rejects(self) -> int:
        return len(self._rejects)

    @property
    def rejects(self) -> list[dict[str, Any]]:
        return [self._rejects[k] for k in sorted(self._rejects)]

    @property
    def committed_supervised(self) -> int:
        return int(sum(int(r["num_supervised"]) for r in self._samples))

    @property
    def next_ordinal(self) -> int:
        return self._next_ordinal

    def close(self) -> None:
        """Write the partial last shard, commit with `complete: true`, release the lock."""
        try:
            if not self.complete:
                self._flush(final=True)
        finally:
            self._release()

    def abort(self) -> None:
        """Stop without completing: committed shards stay; buffered tokens are recomputed on resume."""
        self._release()

    def __enter__(self) -> CacheWriter:
        return self.open()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
