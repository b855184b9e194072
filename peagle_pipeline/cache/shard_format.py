"""The bytes of one stored array, as Zarr v3's sharding codec lays them out: what the fast read paths decode.

An array is split into shards of `shard_tokens` rows (one file or object each); a shard holds inner chunks of
`chunk_tokens` rows and ends with its index: (offset, nbytes) uint64 per inner chunk, then the index's crc32c.
An absent chunk has offset and nbytes 2**64 - 1 and reads as the fill value. Chunks are raw, zstd, raw + crc32c
or blosc + crc32c. This module parses `zarr.json`, a shard's index and its chunks from bytes handed to it; it
never opens a file (the readers in `store_reader.py` fetch the bytes: pread locally, ranged GETs remotely).
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import numpy as np
import zstandard
from zstandard import ZstdError as _ZstdError

from peagle_pipeline.cache import layout
from peagle_pipeline.errors import CorruptCache

__all__ = [
    "ArrayInfo",
    "EMPTY",
    "index_bytes",
    "byte_range",
    "contiguous",
    "parse_index",
    "ChunkBytes",
    "decode_chunks_into",
]

EMPTY = np.uint64(2**64 - 1)
"""Index entry (offset and nbytes) of an inner chunk that is not stored."""

_FAST_CODECS = (["bytes"], ["bytes", "zstd"], ["bytes", "crc32c"], ["bytes", "blosc", "crc32c"])


class ArrayInfo:
    """Static description of one stored array, parsed from its zarr.json. `fast` is True when its layout is one
    the readers decode themselves (sharded, little-endian, an inner codec chain of `_FAST_CODECS`, index at the
    end with a crc32c); other arrays are read through Zarr."""

    def __init__(self, name: str, meta: dict[str, Any]) -> None:
        self.name = name
        self.dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        self.inner = tuple(meta["shape"][1:])
        self.shard_tokens = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        self.fill_value = meta.get("fill_value", 0)
        self.logical_dtype = meta.get("attributes", {}).get("logical_dtype")
        codecs = meta["codecs"]
        self.fast = False
        if len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed":
            conf = codecs[0]["configuration"]
            inner_codecs = [c["name"] for c in conf["codecs"]]
            index_codecs = [c["name"] for c in conf["index_codecs"]]
            endian = [
                c.get("configuration", {}).get("endian", "little")
                for c in conf["codecs"]
                if c["name"] == "bytes"
            ]
            self.chunk_tokens = int(conf["chunk_shape"][0])
            self.zstd = inner_codecs == ["bytes", "zstd"]
            self.crc = inner_codecs == ["bytes", "crc32c"]
            self.blosc = inner_codecs == ["bytes", "blosc", "crc32c"]
            self.fast = (
                inner_codecs in _FAST_CODECS
                and index_codecs == ["bytes", "crc32c"]
                and conf.get("index_location", "end") == "end"
                and endian == ["little"]
                and list(conf["chunk_shape"][1:]) == list(self.inner)
            )
            self.chunks_per_shard = self.shard_tokens // self.chunk_tokens
        else:
            self.chunk_tokens = self.shard_tokens
            self.zstd = self.crc = self.blosc = False
            self.chunks_per_shard = 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one decoded row."""
        return self.dtype.itemsize * math.prod(self.inner)

    def shard_key(self, shard: int) -> str:
        """The shard's path relative to its store (Zarr v3's default chunk key encoding)."""
        return f"{self.name}/" + "/".join(["c", str(shard)] + ["0"] * len(self.inner))


def crc32c(data: bytes) -> bytes:
    """crc32c of `data` as the 4 little-endian bytes zarr's crc32c codec appends."""
    import google_crc32c

    return np.uint32(google_crc32c.value(data)).tobytes()


_ZSTD = (
    threading.local()
)  # one reusable decompression context per thread (creating one per chunk costs ~10 us)


def _zstd_decompress(frame: memoryview | bytes, nbytes: int) -> bytes:
    """One zstd frame (as zarr's zstd codec writes it) decoded to exactly `nbytes` bytes, else ValueError."""
    dctx = getattr(_ZSTD, "dctx", None)
    if dctx is None:
        dctx = _ZSTD.dctx = zstandard.ZstdDecompressor()
    data = dctx.decompress(frame, max_output_size=nbytes)
    if len(data) != nbytes:
        raise ValueError(f"decoded {len(data)} bytes, expected {nbytes}")
    return data


def _blosc_decompress(frame: bytes, nbytes: int) -> bytes:
    """One blosc frame decoded to exactly `nbytes` bytes, else ValueError. (numcodecs decodes without its thread
    pool in a forked process, e.g. a DataLoader worker, so this is fork-safe.)"""
    from numcodecs import blosc

    data = blosc.decompress(frame)
    if len(data) != nbytes:
        raise ValueError(f"decoded {len(data)} bytes, expected {nbytes}")
    return data


def index_bytes(info: ArrayInfo) -> int:
    """Bytes of a shard's index at its end: (offset, nbytes) uint64 per inner chunk, then a crc32c."""
    return info.chunks_per_shard * layout.SHARD_INDEX_ENTRY + 4


def parse_index(info: ArrayInfo, shard: int, raw: bytes, where: str) -> np.ndarray:
    """[chunks_per_shard, 2] uint64 (offset, nbytes) from the index bytes at the end of shard `shard`;
    CorruptCache (naming `where`, e.g. the store) when their length or crc32c is wrong."""
    if len(raw) != index_bytes(info) or crc32c(raw[:-4]) != raw[-4:]:
        raise CorruptCache(f"{where}: shard index of {info.name}/c/{shard} is damaged")
    return np.frombuffer(raw[:-4], dtype="<u8").reshape(info.chunks_per_shard, 2)


def byte_range(span: np.ndarray) -> tuple[int, int]:
    """[begin, end) bytes of a shard that hold the present chunks of `span` (index rows); (0, 0) if none."""
    present = span[:, 0] != EMPTY
    if not present.any():
        return 0, 0
    return int(span[present, 0].min()), int((span[present, 0] + span[present, 1]).max())


def contiguous(span: np.ndarray, chunk_bytes: int) -> bool:
    """True when the chunks of `span` are each `chunk_bytes` long and stored back to back."""
    return bool((span[:, 1] == chunk_bytes).all() and (span[1:, 0] == span[:-1, 0] + span[:-1, 1]).all())


class ChunkBytes(NamedTuple):
    """Consecutive chunks of one shard as read: the first one's index, their index rows `span` ([n, 2] offset and
    length, EMPTY for an absent chunk) and the bytes `blob` read for them from shard offset `base`."""

    chunk: int
    span: np.ndarray
    blob: bytes
    base: int


def decode_chunks_into(out: np.ndarray, info: ArrayInfo, got: ChunkBytes, start: int, where: str) -> None:
    """Decode the chunks `got` into the rows of `out` (= rows [start, start + len(out)) of the array) that they
    cover; absent chunks give the fill value.

    Raises CorruptCache (naming `where`) for a chunk that is truncated, fails its crc32c or decodes to the wrong
    size.
    """
    chunk, span, blob, base = got
    stop = start + len(out)
    C = info.chunk_tokens
    chunk_bytes = C * info.row_bytes
    for j in range(len(span)):
        c = chunk + j
        lo, hi = max(start, c * C), min(stop, (c + 1) * C)
        dest = out[lo - start : hi - start]
        if span[j, 0] == EMPTY:
            dest[...] = info.fill_value
            continue
        off, n = int(span[j, 0]) - base, int(span[j, 1])
        raw: memoryview | bytes = memoryview(blob)[off : off + n]
        try:
            if len(raw) != n:
                raise ValueError("truncated")
            if info.zstd:
                raw = _zstd_decompress(raw, chunk_bytes)
            elif info.crc or info.blosc:  # raw or blosc chunk + its little-endian crc32c (zarr's codec)
                body = bytes(raw[:-4])  # google_crc32c takes bytes only; frombuffer reuses it below
                if (info.crc and n != chunk_bytes + 4) or crc32c(body) != bytes(raw[-4:]):
                    raise ValueError("crc32c mismatch")
                raw = _blosc_decompress(body, chunk_bytes) if info.blosc else body
            rows = np.frombuffer(raw, dtype=info.dtype).reshape(-1, *info.inner)
        except (RuntimeError, ValueError, _ZstdError) as err:
            raise CorruptCache(f"{where}: chunk {c} of {info.name} cannot be decoded ({err})") from None
        if len(rows) != C:
            raise CorruptCache(f"{where}: chunk {c} of {info.name} has a wrong size")
        dest[...] = rows[lo - c * C : hi - c * C]
