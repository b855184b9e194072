"""Read-only access to an extraction cache: metadata, per-sample tables, sample tensors, summaries, verification.

Only what the manifests commit is visible. Random sample reads on local disk take a fast path that parses each
shard's index once and reads just the inner chunks a sample needs (`os.pread` + zstd + `np.frombuffer`); other
stores (fsspec URLs such as `memory://` or `s3://`) read through Zarr's own store layer. File handles are opened
lazily per process, so a `Cache` may be handed to DataLoader workers (fork or spawn). Never writes.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.writer import file_hash
from peagle_pipeline.errors import BadInput, CorruptCache, IncompatibleCache

if TYPE_CHECKING:
    import pandas as pd
    import torch

__all__ = ["SampleArrays", "Cache", "open_cache"]

_EMPTY = np.uint64(2**64 - 1)


@dataclass
class SampleArrays:
    """One sample's cached rows (unshifted: row t = token x_t, aux g_t, mask m_t, target for x_{t+1}).

    Attributes:
        input_ids: int64 [T]; loss_mask: bool [T];
        aux_hidden: [T, n_aux, H] bfloat16 (a view of the stored bits) or float32;
        topk_ids: int64 [T, k]; topk_logprobs: float32 [T, k];
        last_hidden: [T, H] pre-norm last-layer output, or None when the cache has none.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    last_hidden: torch.Tensor | None = None


class _Root:
    """The cache location: a local directory, or an fsspec URL (read through fsspec / Zarr's store layer)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        text = os.fspath(path)
        self.url = text
        self.local: Path | None = None
        self.fs: Any = None
        if "://" in text and not text.startswith("file://"):
            import fsspec

            self.fs, self.base = fsspec.core.url_to_fs(text)
        else:
            self.local = Path(text.removeprefix("file://"))

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

    def zarr_group(self, rel: str) -> Any:
        import zarr

        if self.local is not None:
            return zarr.open_group(str(self.local / rel), mode="r")
        return zarr.open_group(f"{self.url.rstrip('/')}/{rel}", mode="r")


def _crc32c(data: bytes) -> bytes:
    """crc32c of `data` as the 4 little-endian bytes zarr's crc32c codec appends."""
    import google_crc32c

    return np.uint32(google_crc32c.value(data)).tobytes()


class _ArrayInfo:
    """Static description of one stored array, parsed from its zarr.json (for the fast path)."""

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
            self.fast = (
                inner_codecs in (["bytes"], ["bytes", "zstd"], ["bytes", "crc32c"])
                and index_codecs == ["bytes", "crc32c"]
                and conf.get("index_location", "end") == "end"
                and endian == ["little"]
                and list(conf["chunk_shape"][1:]) == list(self.inner)
            )
            self.chunks_per_shard = self.shard_tokens // self.chunk_tokens
        else:
            self.chunk_tokens = self.shard_tokens
            self.zstd = self.crc = False
            self.chunks_per_shard = 1


class _StoreReader:
    """Reads token ranges of one store. Local: pread fast path; otherwise zarr. Lazily opened per process."""

    def __init__(self, root: _Root, name: str, manifest: dict[str, Any], specs: dict[str, Any]) -> None:
        self.root = root
        self.name = name
        self.rel = f"{layout.STORES_DIR}/{name}"
        self.manifest = manifest
        self.specs = specs
        self.info: dict[str, _ArrayInfo] = {}
        for array, (dtype, inner) in specs.items():
            try:
                info = _ArrayInfo(array, json.loads(root.read_bytes(f"{self.rel}/{array}/zarr.json")))
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
        self._zstd: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_pid=-1, _fds={}, _index={}, _zarr=None, _zstd=None)
        return state

    def _check_process(self) -> None:
        """After a fork, drop the parent's handles (pread needs no shared offset, but keep them apart)."""
        if self._pid != os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds, self._index, self._zarr = {}, {}, None
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

    def _fd(self, info: _ArrayInfo, shard: int) -> int:
        key = (info.name, shard)
        fd = self._fds.get(key)
        if fd is None:
            assert self.root.local is not None
            path = (
                self.root.local / self.rel / info.name / "/".join(["c", str(shard)] + ["0"] * len(info.inner))
            )
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptCache(
                    f"store {self.name}: shard file {info.name}/c/{shard} is missing"
                ) from None
            self._fds[key] = fd
        return fd

    def _shard_index(self, info: _ArrayInfo, shard: int) -> np.ndarray:
        """[chunks_per_shard, 2] uint64 (offset, nbytes) of each inner chunk; parsed once per shard."""
        key = (info.name, shard)
        index = self._index.get(key)
        if index is None:
            import google_crc32c

            fd = self._fd(info, shard)
            size = os.fstat(fd).st_size
            nbytes = info.chunks_per_shard * layout.SHARD_INDEX_ENTRY + 4
            raw = os.pread(fd, nbytes, size - nbytes)
            if len(raw) != nbytes or np.uint32(google_crc32c.value(raw[:-4])).tobytes() != raw[-4:]:
                raise CorruptCache(f"store {self.name}: shard index of {info.name}/c/{shard} is damaged")
            index = np.frombuffer(raw[:-4], dtype="<u8").reshape(info.chunks_per_shard, 2)
            self._index[key] = index
        return index

    def _read_fast(self, info: _ArrayInfo, start: int, stop: int) -> np.ndarray:
        C = info.chunk_tokens
        row_bytes = info.dtype.itemsize * math.prod(info.inner)
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
            present = span[:, 0] != _EMPTY
            lo_row, hi_row = max(start, chunk * C), min(stop, (last + 1) * C)
            if not (info.zstd or info.crc) and present.all() and self._contiguous(span, C * row_bytes):
                # Raw chunks laid out back to back: read exactly the rows needed, straight into `out`.
                dest = out[lo_row - start : hi_row - start].reshape(-1).view(np.uint8)
                pos = int(span[0, 0]) + (lo_row - chunk * C) * row_bytes
                if os.preadv(self._fd(info, shard), [dest], pos) != dest.nbytes:
                    raise CorruptCache(f"store {self.name}: shard {shard} of {info.name} is truncated")
                chunk = last + 1
                continue
            blob = b""
            base = 0
            if present.any():
                base = int(span[present, 0].min())
                end = int((span[present, 0] + span[present, 1]).max())
                blob = os.pread(self._fd(info, shard), end - base, base)  # one read for all chunks needed
            for j in range(len(span)):
                c = chunk + j
                lo, hi = max(start, c * C), min(stop, (c + 1) * C)
                dest = out[lo - start : hi - start]
                if not present[j]:
                    dest[...] = info.fill_value
                    continue
                off, n = int(span[j, 0]) - base, int(span[j, 1])
                raw = memoryview(blob)[off : off + n]
                whole = lo == c * C and hi == (c + 1) * C
                try:
                    if info.zstd:
                        if whole:
                            self._decoder().decode(raw, out=dest)
                            continue
                        raw = self._decoder().decode(raw)
                    elif info.crc:  # raw chunk + little-endian crc32c of it (zarr's crc32c codec)
                        body = bytes(raw[:-4])  # google_crc32c takes bytes only; frombuffer reuses it below
                        if n != C * row_bytes + 4 or _crc32c(body) != bytes(raw[-4:]):
                            raise ValueError("crc32c mismatch")
                        raw = body
                    rows = np.frombuffer(raw, dtype=info.dtype).reshape(-1, *info.inner)
                except (RuntimeError, ValueError) as err:
                    raise CorruptCache(
                        f"store {self.name}: chunk {c} of {info.name} cannot be decoded ({err})"
                    ) from None
                if len(rows) != C:
                    raise CorruptCache(f"store {self.name}: chunk {c} of {info.name} has a wrong size")
                dest[...] = rows[lo - c * C : hi - c * C]
            chunk = last + 1
        return out

    def _read_crc_chunks(self, info: _ArrayInfo, first: int, last: int, row_bytes: int) -> np.ndarray | None:
        """Whole chunks first..last of one shard, read with one preadv straight into a numpy buffer (the crc32c
        trailers into a side buffer) and checked in place; None when they are not stored back to back."""
        import google_crc32c

        C = info.chunk_tokens
        shard, local = divmod(first, info.chunks_per_shard)
        span = self._shard_index(info, shard)[local : local + last - first + 1]
        chunk_bytes = C * row_bytes
        if not ((span[:, 0] != _EMPTY).all() and self._contiguous(span, chunk_bytes + 4)):
            return None
        n = len(span)
        rows = np.empty((n * C, *info.inner), dtype=info.dtype)
        flat = rows.reshape(-1).view(np.uint8)
        trailers = np.empty(4 * n, dtype=np.uint8)
        views: list[np.ndarray] = []
        for j in range(n):
            views += [flat[j * chunk_bytes : (j + 1) * chunk_bytes], trailers[4 * j : 4 * j + 4]]
        if os.preadv(self._fd(info, shard), views, int(span[0, 0])) != n * (chunk_bytes + 4):
            raise CorruptCache(f"store {self.name}: shard {shard} of {info.name} is truncated")
        expected = trailers.view("<u4")
        for j in range(n):
            if google_crc32c.value(flat[j * chunk_bytes : (j + 1) * chunk_bytes]) != int(expected[j]):
                raise CorruptCache(
                    f"store {self.name}: chunk {first + j} of {info.name} cannot be decoded (crc32c mismatch)"
                )
        return rows

    @staticmethod
    def _contiguous(span: np.ndarray, chunk_bytes: int) -> bool:
        return bool((span[:, 1] == chunk_bytes).all() and (span[1:, 0] == span[:-1, 0] + span[:-1, 1]).all())

    def _decoder(self) -> Any:
        if self._zstd is None:
            from numcodecs import Zstd

            self._zstd = Zstd()
        return self._zstd


class Cache:
    """An opened cache (read-only). See `open_cache`."""

    def __init__(self, root: _Root, meta: CacheMeta, manifests: dict[str, dict[str, Any] | None]) -> None:
        import pandas as pd

        self._root = root
        self.meta = meta
        self.path = root.url
        self.manifests = manifests
        self.specs = layout.array_specs(meta)
        self._stores: dict[str, _StoreReader] = {}
        frames, rejects = [], []
        for name, manifest in manifests.items():
            if manifest is None:
                continue
            try:
                if CacheMeta.from_dict(manifest["meta"]).differences(meta):
                    raise CorruptCache(f"store {name}: its manifest disagrees with {layout.CACHE_META}")
                self._stores[name] = _StoreReader(root, name, manifest, self.specs)
                blob = root.read_bytes(f"{layout.STORES_DIR}/{name}/{layout.SAMPLES_TABLE}")
                _check_table(name, manifest, layout.SAMPLES_TABLE, blob)
                table = pd.read_parquet(io.BytesIO(blob))
                frames.append(table.iloc[: int(manifest["committed_samples"])][list(layout.SAMPLE_COLUMNS)])
                rel = f"{layout.STORES_DIR}/{name}/{layout.REJECTS_TABLE}"
                if root.exists(rel):
                    blob = root.read_bytes(rel)
                    _check_table(name, manifest, layout.REJECTS_TABLE, blob)
                    rejects.append(pd.read_parquet(io.BytesIO(blob))[list(layout.REJECT_COLUMNS)])
            except CorruptCache:
                raise
            except (OSError, ValueError, KeyError, TypeError, IndexError) as err:  # pyarrow's errors included
                raise CorruptCache(
                    f"store {name} of {root.url} is damaged ({type(err).__name__}); run `peagle-pipeline verify`"
                ) from None
        cols = list(layout.SAMPLE_COLUMNS)
        self.samples: pd.DataFrame = (
            pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
        )[cols]
        self.rejects: pd.DataFrame = (
            pd.concat(rejects, ignore_index=True).sort_values("sample_id", ignore_index=True)
            if rejects
            else pd.DataFrame(columns=list(layout.REJECT_COLUMNS))
        )
        # Hot-path lookup tables: sample id -> (store number, offset, length), sorted by id for searchsorted.
        names = list(self._stores)
        order = np.argsort(self.samples["sample_id"].to_numpy(dtype=np.int64), kind="stable")
        self._ids = self.samples["sample_id"].to_numpy(dtype=np.int64)[order]
        self._store_of = np.array([names.index(s) for s in self.samples["store"]], dtype=np.int64)[order]
        self._offsets = self.samples["offset"].to_numpy(dtype=np.int64)[order]
        self._lengths = self.samples["length"].to_numpy(dtype=np.int64)[order]
        self._store_names = names
        self._tokenizer: Any = None

    # ------------------------------------------------------------------------------------------- basics
    @property
    def target_dir(self) -> Path:
        """Local directory of the target's config.json and tokenizer files (local caches only)."""
        if self._root.local is None:
            raise BadInput(
                f"target_dir needs a local cache; {self.path} is remote (use target_config/pieces)"
            )
        return self._root.local / layout.TARGET_DIR

    def target_config(self) -> dict[str, Any]:
        return json.loads(self._root.read_bytes(f"{layout.TARGET_DIR}/config.json"))

    def target_pieces(self) -> dict[str, torch.Tensor]:
        """The target's embed_tokens.weight [V, H], lm_head.weight [V, H], norm.weight [H] (keys layout.PIECE_KEYS)."""
        from safetensors.torch import load

        pieces = load(self._root.read_bytes(f"{layout.TARGET_DIR}/{layout.PIECES_FILE}"))
        missing = [k for k in layout.PIECE_KEYS if k not in pieces]
        if missing:
            raise IncompatibleCache(f"{self.path}: target pieces lack {', '.join(missing)}")
        return {k: pieces[k] for k in layout.PIECE_KEYS}

    def token_counts(self) -> np.ndarray:
        """int64 [V]: how often each token id is a supervised token, summed over all stores."""
        total = np.zeros(self.meta.vocab_size, dtype=np.int64)
        for name in self._stores:
            try:
                raw = self._root.read_bytes(f"{layout.STORES_DIR}/{name}/{layout.TOKEN_COUNTS}")
            except FileNotFoundError:
                raise CorruptCache(f"store {name}: {layout.TOKEN_COUNTS} is missing") from None
            _check_table(name, self.manifests[name] or {}, layout.TOKEN_COUNTS, raw)
            try:
                counts = np.load(io.BytesIO(raw), allow_pickle=False).astype(np.int64)
                total += counts.reshape(self.meta.vocab_size)
            except (ValueError, OSError, EOFError) as err:
                raise CorruptCache(
                    f"store {name}: {layout.TOKEN_COUNTS} is damaged ({type(err).__name__})"
                ) from None
        return total

    def __len__(self) -> int:
        return len(self._ids)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        return state

    def close(self) -> None:
        for store in self._stores.values():
            store.close()

    # -------------------------------------------------------------------------------------------- reads
    def locate(self, sample_id: int) -> tuple[str, int, int]:
        """(store name, offset, length) of a sample; BadInput if the cache has no such sample."""
        i = int(np.searchsorted(self._ids, sample_id))
        if i >= len(self._ids) or self._ids[i] != sample_id:
            raise BadInput(f"sample {sample_id} is not in cache {self.path}")
        return self._store_names[self._store_of[i]], int(self._offsets[i]), int(self._lengths[i])

    def read_arrays(self, sample_id: int, fast: bool = True) -> dict[str, np.ndarray]:
        """A sample's arrays in their stored numpy dtypes (fast=False reads through zarr)."""
        store, offset, length = self.locate(sample_id)
        reader = self._stores[store]
        return {name: reader.read(name, offset, offset + length, fast=fast) for name in self.specs}

    def read_sample(self, sample_id: int) -> SampleArrays:
        """The sample's tensors (see SampleArrays). Hidden states are zero-copy bf16 views of the stored bits."""
        import torch

        a = self.read_arrays(sample_id)
        dtype = self.meta.hidden_dtype
        return SampleArrays(
            input_ids=torch.from_numpy(a["input_ids"].astype(np.int64)),
            loss_mask=torch.from_numpy(a["loss_mask"]),
            aux_hidden=layout.from_storage(a["aux_hidden"], dtype),
            topk_ids=torch.from_numpy(a["topk_ids"].astype(np.int64)),
            topk_logprobs=torch.from_numpy(a["topk_logprobs"].astype(np.float32)),
            last_hidden=layout.from_storage(a["last_hidden"], dtype) if "last_hidden" in a else None,
        )

    # ---------------------------------------------------------------------------------- human-readable
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.target_dir))
        return self._tokenizer

    def tokens(self, sample_id: int) -> pd.DataFrame:
        """One row per position: position, token_id, token, loss_mask, top1_token, top1_prob, topk_entropy.

        top1_* is the target's most likely NEXT token (row t predicts x_{t+1}); topk_entropy is the entropy
        (nats) of the top-k probabilities renormalised to sum to 1.
        """
        import pandas as pd

        a = self.read_arrays(sample_id)
        tok = self.tokenizer()
        ids = a["input_ids"].astype(np.int64)
        top1 = a["topk_ids"][:, 0].astype(np.int64) if self.meta.topk else ids
        lp = a["topk_logprobs"].astype(np.float64)
        p = np.exp(lp)
        q = p / np.clip(p.sum(axis=1, keepdims=True), 1e-30, None)
        entropy = -(q * np.log(np.clip(q, 1e-30, None))).sum(axis=1)
        return pd.DataFrame(
            {
                "position": np.arange(len(ids)),
                "token_id": ids,
                "token": [tok.decode([int(i)]) for i in ids],
                "loss_mask": a["loss_mask"],
                "top1_token": [tok.decode([int(i)]) for i in top1],
                "top1_prob": p[:, 0],
                "topk_entropy": entropy,
            }
        )

    def describe_sample(self, sample_id: int, rows: int = 60) -> str:
        """A header line plus the first `rows` token rows (0 = all) as a text table."""
        import pandas as pd

        store, offset, length = self.locate(sample_id)
        row = self.samples[self.samples["sample_id"] == sample_id].iloc[0]
        table = self.tokens(sample_id)
        shown = table if rows <= 0 else table.head(rows)
        with pd.option_context("display.max_rows", None, "display.width", 200, "display.max_colwidth", 24):
            body = shown.to_string(index=False, float_format=lambda v: f"{v:.3f}")
        head = (
            f"sample {sample_id}: {row['source']} row {row['source_row']}, store {store} offset {offset}, "
            f"{length} tokens, {row['num_supervised']} supervised, truncated={bool(row['truncated'])}"
        )
        more = f"\n... {length - len(shown)} more rows (--rows 0 shows all)" if len(shown) < length else ""
        return f"{head}\n{body}{more}"

    def summary(self) -> str:
        """Settings, sample/token statistics, bytes per token, store sizes and rejects by reason."""
        m = self.meta
        lengths = self.samples["length"].to_numpy(dtype=np.int64)
        tokens = int(lengths.sum())
        supervised = int(self.samples["num_supervised"].sum()) if len(self.samples) else 0
        sizes = {name: self._root.size(f"{layout.STORES_DIR}/{name}") for name in self._stores}
        total = sum(sizes.values())
        lines = [
            f"cache {self.path} (format {m.format_version})",
            f"target: {m.target_name_or_path} ({', '.join(m.target_architectures)}; L={m.num_hidden_layers}, "
            f"H={m.hidden_size}, V={m.vocab_size})",
            f"aux layers {m.aux_layer_ids}, top-k {m.topk}, hidden dtype {m.hidden_dtype}, "
            f"last hidden {'yes' if m.has_last_hidden else 'no'}, max_length {m.max_length} ({m.overlong}), "
            f"compress {m.compress}, shard/chunk {m.shard_tokens}/{m.chunk_tokens} tokens",
            f"data fingerprint {m.dataset_fingerprint}, assistant turns {m.assistant_turns}, "
            f"world size {m.world_size}",
            f"samples: {len(self.samples)}, tokens: {tokens}, supervised: {supervised} "
            f"({supervised / max(tokens, 1):.1%}), truncated: {int(self.samples['truncated'].sum()) if len(self.samples) else 0}",
        ]
        if len(lengths):
            q = np.percentile(lengths, [50, 90, 99])
            lines.append(
                f"length: min {lengths.min()}, median {q[0]:.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, "
                f"max {lengths.max()}, mean {lengths.mean():.1f}"
            )
        lines.append(
            f"bytes: {total / 1e6:.2f} MB in {len(sizes)} store(s), {total / max(tokens, 1):.1f} bytes/token"
        )
        for name, size in sizes.items():
            man = self.manifests[name] or {}
            state = "complete" if man.get("complete") else "INCOMPLETE"
            lines.append(
                f"  {name}: {size / 1e6:.2f} MB, {man.get('committed_samples', 0)} samples, "
                f"{man.get('committed_tokens', 0)} tokens, {state}"
            )
        missing = [n for n, man in self.manifests.items() if man is None]
        if missing:
            lines.append(f"  missing stores: {', '.join(missing)}")
        if len(self.rejects):
            lines.append(f"rejects: {len(self.rejects)}")
            for reason, n in self.rejects["reason"].value_counts().items():
                lines.append(f"  {n:6d}  {reason}")
        else:
            lines.append("rejects: 0")
        return "\n".join(lines)

    # ------------------------------------------------------------------------------------------- verify
    def verify(self) -> list[str]:
        """Read everything back; one line per problem naming the store (and samples) affected. Empty = ok."""
        from peagle_pipeline.cache.verify import verify_cache

        return verify_cache(self)


def _check_table(store: str, manifest: dict[str, Any], table: str, blob: bytes) -> None:
    """A complete store's tables never change after its last commit: a hash mismatch is damage.

    (An incomplete store's table may legitimately run ahead of its manifest while a writer commits.)
    """
    if manifest.get("complete") and file_hash(blob) != manifest.get("tables", {}).get(table):
        raise CorruptCache(
            f"store {store}: {table} does not match its manifest checksum; run `peagle-pipeline verify`"
        )


def _read_json(root: _Root, rel: str) -> dict[str, Any] | None:
    try:
        data = json.loads(root.read_bytes(rel))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CorruptCache(f"{root.url}/{rel} is not valid JSON; the cache is damaged") from None
    if not isinstance(data, dict):
        raise CorruptCache(f"{root.url}/{rel} is not a JSON object; the cache is damaged")
    return data


def open_cache(path: str | os.PathLike[str], check: bool = True) -> Cache:
    """Open a cache read-only.

    Args:
        path: the cache directory, or an fsspec URL of one (`memory://...`, `s3://...`: read through Zarr's
            store layer; tokenizer files then need a local copy).
        check: require every store of the cache to be present and complete (training needs this);
            False opens whatever is committed (for `inspect` / `verify` of a partial cache).

    Raises:
        IncompatibleCache: not a cache, other format version, a store missing or incomplete (when check).
    """
    root = _Root(path)
    meta_dict = _read_json(root, layout.CACHE_META)
    if meta_dict is None:
        raise IncompatibleCache(
            f"{root.url} is not a peagle cache (no {layout.CACHE_META}); run `peagle-pipeline extract` first"
        )
    if meta_dict.get("format_version") != layout.FORMAT_VERSION:
        raise IncompatibleCache(
            f"{root.url} has cache format {meta_dict.get('format_version')}, this version "
            f"reads {layout.FORMAT_VERSION}; re-extract it"
        )
    try:
        meta = CacheMeta.from_dict(meta_dict)
        layout.array_specs(meta)
    except (TypeError, ValueError, KeyError) as err:
        raise CorruptCache(f"{root.url}/{layout.CACHE_META} is damaged ({type(err).__name__})") from None
    manifests: dict[str, dict[str, Any] | None] = {}
    for rank in range(meta.world_size):
        name = layout.store_name(rank, meta.world_size)
        manifests[name] = _read_json(root, f"{layout.STORES_DIR}/{name}/{layout.MANIFEST}")
    if check:
        missing = [n for n, m in manifests.items() if m is None]
        if missing:
            raise IncompatibleCache(
                f"{root.url}: store(s) {', '.join(missing)} missing; run extract for those ranks"
            )
        partial = [n for n, m in manifests.items() if m is not None and not m.get("complete")]
        if partial:
            raise IncompatibleCache(
                f"{root.url}: store(s) {', '.join(partial)} incomplete; re-run extract to finish"
            )
    return Cache(root, meta, manifests)
