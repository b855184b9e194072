"""Low-level reads of one cache store: the cache location (local directory or fsspec URL) and a per-store reader.

Sample reads of the usual layouts (`shard_format.ArrayInfo.fast`) skip Zarr's store layer. On local disk each
shard's index is parsed once and just the inner chunks a range of tokens needs are read: raw chunks with one
`os.preadv` straight into the output (crc32c checked in place), zstd and blosc chunks decoded with a reused
context. On an object store (fsspec URLs such as `memory://` or `s3://`) the same chunks are fetched as byte ranges
issued together (`object_ranges.py`). Other layouts read through Zarr. File handles and filesystem instances are
opened lazily per process, so a reader may be handed to DataLoader workers (fork or spawn). Never writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.object_ranges import fetch_ranges, unreachable
from peagle_pipeline.cache.remote import describe_error
from peagle_pipeline.cache.shard_format import (
    EMPTY,
    ArrayInfo,
    ChunkBytes,
    byte_range,
    contiguous,
    decode_chunks_into,
    index_bytes,
    parse_index,
)
from peagle_pipeline.errors import BadInput, CorruptCache, StoreUnreachable

__all__ = ["StoreRoot", "StoreReader"]


class StoreRoot:
    """The cache location: a local directory, or an fsspec URL (read through fsspec / Zarr's store layer)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        text = os.fspath(path)
        self.url = text
        self.local: Path | None = None
        self.fs: Any = None
        if "://" in text and not text.startswith("file://"):
            import fsspec

            self.fs, self.base = fsspec.core.url_to_fs(text)
            self.fs.invalidate_cache()  # (a cached instance's listings may predate the objects now there)
            self._check_reachable()
        else:
            self.local = Path(text.removeprefix("file://"))

    def _check_reachable(self) -> None:
        """BadInput (one line) when the bucket of a bucket-based URL (s3://) is missing or its endpoint cannot be
        reached: fsspec's `exists` would say False and the cache would look absent."""
        bucket = self.base.split("/", 1)[0]
        if not bucket:
            return
        try:
            self.fs.info(bucket)
        except FileNotFoundError:
            raise BadInput(f"cannot read the cache {self.url}: bucket {bucket!r} does not exist") from None
        except Exception as err:  # s3fs/aiohttp/botocore raise many types
            raise BadInput(f"cannot reach {self.url}: {describe_error(err)}") from None

    def raise_if_unreachable(self) -> None:
        """StoreUnreachable when this location is an object store that does not answer now: a read that failed
        there is the network's doing, not the cache's. Nothing for a local directory, or a store that answers
        (a missing object is an answer)."""
        if self.fs is None:
            return
        try:
            self.fs.invalidate_cache()
            self.fs.info(f"{self.base}/{layout.CACHE_META}")
        except FileNotFoundError:
            return
        except Exception as err:  # s3fs/aiohttp/botocore raise many types
            raise unreachable(self.url, err) from None

    def read_bytes(self, rel: str) -> bytes:
        if self.local is not None:
            return (self.local / rel).read_bytes()
        with self.fs.open(f"{self.base}/{rel}", "rb") as f:
            return f.read()

    def exists(self, rel: str) -> bool:
        if self.local is not None:
            return (self.local / rel).exists()
        return bool(self.fs.exists(f"{self.base}/{rel}"))

    def size(self, rel: str) -> int:
        """Bytes under `rel` (a file or a directory tree)."""
        if self.local is not None:
            p = self.local / rel
            if p.is_file():
                return p.stat().st_size
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        return int(self.fs.du(f"{self.base}/{rel}"))

    def local_copy(self, rel: str) -> Path:
        """A local copy of the directory `rel` of a remote cache (downloaded once per process, to a temporary
        directory removed at exit)."""
        if self.local is not None:
            return self.local / rel
        copies: dict[str, Path] = self.__dict__.setdefault("_copies", {})
        if rel not in copies:
            import atexit
            import shutil
            import tempfile

            tmp = Path(tempfile.mkdtemp(prefix="peagle-remote-"))
            atexit.register(shutil.rmtree, tmp, True)
            self.fs.get(f"{self.base}/{rel}/", f"{tmp / rel}/", recursive=True)
            copies[rel] = tmp / rel
        return copies[rel]

    def zarr_group(self, rel: str) -> Any:
        import zarr

        if self.local is not None:
            return zarr.open_group(str(self.local / rel), mode="r")
        return zarr.open_group(f"{self.url.rstrip('/')}/{rel}", mode="r")


class StoreReader:
    """Reads token ranges of one store. Local: pread fast path; otherwise zarr. Lazily opened per process."""

    def __init__(self, root: StoreRoot, name: str, manifest: dict[str, Any], specs: dict[str, Any]) -> None:
        self.root = root
        self.name = name
        self.rel = f"{layout.STORES_DIR}/{name}"
        self.manifest = manifest
        self.specs = specs
        self.info: dict[str, ArrayInfo] = {}
        for array, (dtype, inner) in specs.items():
            try:
                info = ArrayInfo(array, json.loads(root.read_bytes(f"{self.rel}/{array}/zarr.json")))
                ok = (
                    info.dtype == np.dtype(dtype).newbyteorder("<")
                    and info.inner == tuple(inner)
                    and info.shard_tokens == int(manifest["shard_tokens"])
                    and info.chunk_tokens == int(manifest["chunk_tokens"])
                )
            except (OSError, ValueError, KeyError, TypeError, IndexError, ZeroDivisionError) as err:
                raise CorruptCache(
                    f"store {name}: {array}/zarr.json is damaged ({type(err).__name__})"
                ) from None
            if not ok:
                raise CorruptCache(f"store {name}: {array}/zarr.json disagrees with the cache metadata")
            self.info[array] = info
        self._pid = -1
        self._fds: dict[tuple[str, int], int] = {}
        self._index: dict[tuple[str, int], np.ndarray] = {}
        self._zarr: Any = None
        self._fs: Any = None  # this process's fsspec instance (object stores)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_pid=-1, _fds={}, _index={}, _zarr=None, _fs=None)
        return state

    def _check_process(self) -> None:
        """After a fork, drop the parent's handles (pread needs no shared offset, but keep them apart)."""
        if self._pid != os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds, self._index, self._zarr, self._fs = {}, {}, None, None
            self._pid = os.getpid()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def read(self, array: str, start: int, stop: int, fast: bool = True) -> np.ndarray:
        """Rows [start, stop) of `array` in their stored dtype, shape [stop-start, *inner]."""
        self._check_process()
        info = self.info[array]
        try:
            if fast and info.fast and self.root.local is not None:
                return self._read_fast(info, start, stop)
            if self._zarr is None:
                self._zarr = self.root.zarr_group(self.rel)
            return np.asarray(self._zarr[array][start:stop])
        except CorruptCache:
            raise
        except Exception as err:  # damaged bytes surface as codec, crc, size or value errors of many types
            raise CorruptCache(
                f"store {self.name}: {array} tokens {start}..{stop} cannot be read ({type(err).__name__})"
            ) from None

    def prefetch(self, start: int, stop: int) -> None:
        """Ask the kernel to start reading the bytes of token rows [start, stop) of every array at once
        (posix_fadvise WILLNEED), so that on a cold page cache the per-array reads that follow overlap their disk
        latency instead of waiting one after another. Local fast-path stores only. A hint: any problem is left for
        the reads that follow to report."""
        if self.root.local is None or not hasattr(os, "posix_fadvise"):
            return
        self._check_process()
        try:
            for info in self.info.values():
                if info.fast:
                    self._prefetch_array(info, start, stop)
        except (CorruptCache, OSError, ValueError):
            return

    def _prefetch_array(self, info: ArrayInfo, start: int, stop: int) -> None:
        first, last = start // info.chunk_tokens, (stop - 1) // info.chunk_tokens
        per_shard = info.chunks_per_shard
        for shard in range(first // per_shard, last // per_shard + 1):
            lo = max(first, shard * per_shard) - shard * per_shard
            hi = min(last, (shard + 1) * per_shard - 1) - shard * per_shard
            span = self._shard_index(info, shard)[lo : hi + 1]
            span = span[span[:, 0] != EMPTY]
            if len(span):
                begin = int(span[:, 0].min())
                end = int((span[:, 0] + span[:, 1]).max())
                os.posix_fadvise(self._fd(info, shard), begin, end - begin, os.POSIX_FADV_WILLNEED)

    def _fd(self, info: ArrayInfo, shard: int) -> int:
        key = (info.name, shard)
        fd = self._fds.get(key)
        if fd is None:
            assert self.root.local is not None
            path = self.root.local / self._shard_rel(info, shard)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptCache(
                    f"store {self.name}: shard file {info.name}/c/{shard} is missing"
                ) from None
            self._fds[key] = fd
        return fd

    def _shard_rel(self, info: ArrayInfo, shard: int) -> str:
        """The shard object's path relative to the cache root (Zarr v3's default chunk key encoding)."""
        return f"{self.rel}/{info.shard_key(shard)}"

    def _shard_index(self, info: ArrayInfo, shard: int) -> np.ndarray:
        """[chunks_per_shard, 2] uint64 (offset, nbytes) of each inner chunk; parsed once per shard."""
        key = (info.name, shard)
        index = self._index.get(key)
        if index is None:
            fd = self._fd(info, shard)
            nbytes = index_bytes(info)
            index = self._parse_index(info, shard, os.pread(fd, nbytes, os.fstat(fd).st_size - nbytes))
        return index

    def _parse_index(self, info: ArrayInfo, shard: int, raw: bytes) -> np.ndarray:
        """Check (length, crc32c) and cache the index bytes read from the end of a shard."""
        index = parse_index(info, shard, raw, f"store {self.name}")
        self._index[(info.name, shard)] = index
        return index

    # ------------------------------------------------------------------------------------ object stores
    def read_many(self, arrays: list[str], start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows [start, stop) of several arrays (see `read`).

        On an object store every fast-path array is read with ranged GETs issued together (fsspec's
        `cat_ranges`, concurrent on async stores such as s3fs): first the index of each shard not seen before
        (a suffix range, cached), then one range per array and shard covering the chunks needed. Zarr's own store
        layer would instead make a chain of requests per array (its metadata, the shard index, each chunk),
        one after another, every time.
        """
        fast = [a for a in arrays if self.info[a].fast]
        if self.root.local is not None or not fast:
            return {a: self.read(a, start, stop) for a in arrays}
        self._check_process()
        try:
            got = self._read_remote(fast, start, stop)
        except (CorruptCache, StoreUnreachable):
            raise
        except Exception as err:  # damaged bytes surface as codec, size or value errors of many types
            raise CorruptCache(
                f"store {self.name}: tokens {start}..{stop} cannot be read ({type(err).__name__})"
            ) from None
        return {a: got[a] if a in got else self.read(a, start, stop) for a in arrays}

    def _remote_fs(self) -> Any:
        """This process's filesystem instance for the store's URL (fsspec gives a fresh one after a fork)."""
        if self._fs is None:
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.root.url)[0]
        return self._fs

    def _cat_ranges(self, ranges: list[tuple[str, int, int | None]]) -> list[bytes]:
        """Bytes of (path relative to the cache root, start, end) ranges, fetched together (`fetch_ranges`)."""
        base = self.root.base
        return fetch_ranges(self._remote_fs(), [(f"{base}/{r}", a, b) for r, a, b in ranges], self.root.url)

    def _read_remote(self, arrays: list[str], start: int, stop: int) -> dict[str, np.ndarray]:
        pieces = []  # (info, shard, first chunk, last chunk) of every array and shard the rows touch
        for a in arrays:
            info = self.info[a]
            chunk, last = start // info.chunk_tokens, (stop - 1) // info.chunk_tokens
            while chunk <= last:
                shard = chunk // info.chunks_per_shard
                end = min(last, (shard + 1) * info.chunks_per_shard - 1)
                pieces.append((info, shard, chunk, end))
                chunk = end + 1
        wanted = {
            (info.name, shard): info for info, shard, _, _ in pieces if (info.name, shard) not in self._index
        }
        indexes = self._cat_ranges(
            [(self._shard_rel(i, s), -index_bytes(i), None) for (_, s), i in wanted.items()]
        )
        for ((_, shard), info), raw in zip(wanted.items(), indexes, strict=True):
            self._parse_index(info, shard, raw)
        spans: list[tuple[np.ndarray, int]] = []
        ranges: list[tuple[str, int, int | None]] = []
        for info, shard, chunk, last in pieces:
            local = chunk - shard * info.chunks_per_shard
            span = self._index[(info.name, shard)][local : local + last - chunk + 1]
            base, end = byte_range(span)
            spans.append((span, base))
            if end > base:
                ranges.append((self._shard_rel(info, shard), base, end))
        blobs = iter(self._cat_ranges(ranges))
        out = {a: np.empty((stop - start, *self.info[a].inner), dtype=self.info[a].dtype) for a in arrays}
        for (info, _, chunk, _), (span, base) in zip(pieces, spans, strict=True):
            blob = next(blobs) if (span[:, 0] != EMPTY).any() else b""
            decode_chunks_into(
                out[info.name], info, ChunkBytes(chunk, span, blob, base), start, f"store {self.name}"
            )
        return out

    def _read_fast(self, info: ArrayInfo, start: int, stop: int) -> np.ndarray:
        C = info.chunk_tokens
        row_bytes = info.row_bytes
        first, last = start // C, (stop - 1) // C
        if info.crc and first // info.chunks_per_shard == last // info.chunks_per_shard:
            rows = self._read_crc_chunks(info, first, last, row_bytes)
            if rows is not None:  # one read into one buffer, crc-checked in place, returned as a view
                return rows[start - first * C : stop - first * C]
        out = np.empty((stop - start, *info.inner), dtype=info.dtype)
        chunk = first
        while chunk * C < stop:
            shard, local = divmod(chunk, info.chunks_per_shard)
            last = min((stop - 1) // C, (shard + 1) * info.chunks_per_shard - 1)  # last chunk in this shard
            index = self._shard_index(info, shard)
            span = index[local : local + last - chunk + 1]
            present = span[:, 0] != EMPTY
            lo_row, hi_row = max(start, chunk * C), min(stop, (last + 1) * C)
            if (
                not (info.zstd or info.crc or info.blosc)
                and present.all()
                and contiguous(span, C * row_bytes)
            ):
                # Raw chunks laid out back to back: read exactly the rows needed, straight into `out`.
                dest = out[lo_row - start : hi_row - start].reshape(-1).view(np.uint8)
                pos = int(span[0, 0]) + (lo_row - chunk * C) * row_bytes
                if os.preadv(self._fd(info, shard), [dest], pos) != dest.nbytes:  # type: ignore[list-item]
                    raise CorruptCache(f"store {self.name}: shard {shard} of {info.name} is truncated")
                chunk = last + 1
                continue
            blob, base = b"", 0
            if present.any():
                base, end = byte_range(span)
                blob = os.pread(self._fd(info, shard), end - base, base)  # one read for all chunks needed
            got = ChunkBytes(chunk, span, blob, base)
            decode_chunks_into(out, info, got, start, f"store {self.name}")
            chunk = last + 1
        return out

    def _read_crc_chunks(self, info: ArrayInfo, first: int, last: int, row_bytes: int) -> np.ndarray | None:
        """Whole chunks first..last of one shard, read with one preadv straight into a numpy buffer (the crc32c
        trailers into a side buffer) and checked in place; None when they are not stored back to back."""
        import google_crc32c

        C = info.chunk_tokens
        shard, local = divmod(first, info.chunks_per_shard)
        span = self._shard_index(info, shard)[local : local + last - first + 1]
        chunk_bytes = C * row_bytes
        if not ((span[:, 0] != EMPTY).all() and contiguous(span, chunk_bytes + 4)):
            return None
        n = len(span)
        rows = np.empty((n * C, *info.inner), dtype=info.dtype)
        flat = rows.reshape(-1).view(np.uint8)
        trailers = np.empty(4 * n, dtype=np.uint8)
        views: list[np.ndarray] = []
        for j in range(n):
            views += [flat[j * chunk_bytes : (j + 1) * chunk_bytes], trailers[4 * j : 4 * j + 4]]
        if os.preadv(self._fd(info, shard), views, int(span[0, 0])) != n * (chunk_bytes + 4):  # type: ignore[arg-type]
            raise CorruptCache(f"store {self.name}: shard {shard} of {info.name} is truncated")
        expected = trailers.view("<u4")
        for j in range(n):
            if google_crc32c.value(flat[j * chunk_bytes : (j + 1) * chunk_bytes]) != int(expected[j]):
                raise CorruptCache(
                    f"store {self.name}: chunk {first + j} of {info.name} cannot be decoded (crc32c mismatch)"
                )
        return rows
