"""Full read-back check of a cache: checksums, shapes, offsets, tables, token counts, and target/ (the target's
config, tokenizer files and pieces.safetensors, which training reads). Read-only.

Every problem becomes one line naming the store and the samples it touches; an empty list means the cache is
sound. Arrays are read through Zarr itself (the reference decoder), independently of the reader's fast path.
Only what the manifests commit is checked: a store being written (or a copy taken meanwhile) may hold shards and
tables past its manifest; those are the next commit in progress, not damage. Such a store is reported as
incomplete (a `Finding` of kind "incomplete"), never as damage.

On an object store a failed read is damage only if the store answers and the read fails again: when the store
does not answer, verify stops with StoreUnreachable (the cache is not judged), and a read that a dropped
connection broke once is simply read again.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.store_arrays import shard_key
from peagle_pipeline.errors import StoreUnreachable

if TYPE_CHECKING:
    from peagle_pipeline.cache.reader import Cache

__all__ = ["verify_cache", "verify_target", "verify_path", "Finding"]

T = TypeVar("T")


class Finding(str):
    """One line of the verify report; `kind` is "damage" (the data is wrong) or "incomplete" (not finished)."""

    kind: str = "damage"

    @classmethod
    def incomplete(cls, line: str) -> Finding:
        finding = cls(line)
        finding.kind = "incomplete"
        return finding


def verify_path(path: str) -> list[str]:
    """Problems found in the cache at `path`: `verify_cache`'s, or the damage that keeps it from being opened.

    Raises:
        IncompatibleCache: not a cache, or of another format. StoreUnreachable.
    """
    from peagle_pipeline.cache.reader import VERIFY_ADVICE, open_cache
    from peagle_pipeline.errors import CorruptCache

    try:
        cache = open_cache(path, check=False)
    except CorruptCache as err:  # a damaged table or manifest: the store cannot even be listed
        return [Finding(str(err).removesuffix(VERIFY_ADVICE))]
    return verify_target(cache) + verify_cache(cache)


def verify_cache(cache: Cache) -> list[str]:
    """Problems found in the stores of `cache` (see module docstring; its target/: `verify_target`)."""
    problems: list[str] = []
    seen: dict[int, str] = {}
    for name, manifest in cache.manifests.items():
        if manifest is None:
            problems.append(Finding.incomplete(f"{name}: store missing (no manifest)"))
            continue
        if not manifest.get("complete"):
            problems.append(
                Finding.incomplete(
                    f"{name}: incomplete ({manifest['committed_samples']} samples committed); "
                    "re-run extract to finish it"
                )
            )
        problems += _verify_store(cache, name, manifest, seen)
    return problems


def _read(cache: Cache, read: Callable[[], T]) -> T:
    """`read()`; if it fails on an object store: StoreUnreachable when the store does not answer, else one more
    try, whose failure is the caller's to report as damage.

    Raises: StoreUnreachable, or whatever the second `read()` raises."""
    try:
        return read()
    except Exception:
        if cache._root.fs is None:
            raise
        cache._root.raise_if_unreachable()
        return read()


def _samples_in(table: Any, start: int, stop: int) -> str:
    hit = table[(table["offset"] < stop) & (table["offset"] + table["length"] > start)]["sample_id"].tolist()
    if not hit:
        return "no committed samples"
    shown = ", ".join(map(str, hit[:8])) + (f" and {len(hit) - 8} more" if len(hit) > 8 else "")
    return f"samples {shown}"


def _verify_store(cache: Cache, name: str, manifest: dict[str, Any], seen: dict[int, str]) -> list[str]:
    """Problems of one store: its tables, its samples table, its arrays' shards, then the values they hold."""
    out, ahead = _check_tables(cache, name, manifest)
    samples = cache.samples[cache.samples["store"] == name].reset_index(drop=True)
    out += _check_samples(cache, name, manifest, samples, seen)
    try:
        group = _read(cache, lambda: cache._root.zarr_group(f"{layout.STORES_DIR}/{name}"))
    except StoreUnreachable:
        raise
    except Exception as err:  # a damaged zarr.json: zarr raises several types
        return [
            *out,
            f"{name}: Zarr group unreadable ({type(err).__name__}); affects every sample of the store",
        ]
    problems, data = _check_arrays(cache, name, manifest, samples, group)
    return out + problems + _verify_values(cache, name, samples, data, ahead)


def _check_tables(cache: Cache, name: str, manifest: dict[str, Any]) -> tuple[list[str], set[str]]:
    """Table files against their manifest checksums; also returns the tables of an incomplete store rewritten by
    a commit its manifest does not name yet (checked for consistency with the committed part instead)."""
    rel = f"{layout.STORES_DIR}/{name}"
    out: list[str] = []
    ahead: set[str] = set()
    for table, digest in manifest["tables"].items():
        try:
            ok = layout.file_hash(_read(cache, partial(cache._root.read_bytes, f"{rel}/{table}"))) == digest
        except StoreUnreachable:
            raise
        except Exception:  # missing, or unreadable while the store answers
            ok = False
        if not ok and manifest.get("complete"):
            out.append(f"{name}: {table} does not match its manifest checksum (missing or changed)")
        elif not ok:
            ahead.add(table)
    return out, ahead


def _check_samples(
    cache: Cache, name: str, manifest: dict[str, Any], samples: Any, seen: dict[int, str]
) -> list[str]:
    """The samples table of a store: count, contiguous offsets, lengths, ranks, no sample in two stores."""
    out: list[str] = []
    if len(samples) != int(manifest["committed_samples"]):
        out.append(
            f"{name}: samples table holds {len(samples)} of the {manifest['committed_samples']} committed samples"
        )
    n_tokens = int(manifest["committed_tokens"])
    # Offsets: samples tile [0, committed end) in order, each at most max_length long.
    ends = (samples["offset"] + samples["length"]).to_numpy()
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else np.array([], dtype=np.int64)
    bad = samples[samples["offset"].to_numpy() != starts]
    if len(bad):
        out.append(f"{name}: offsets not contiguous at samples {bad['sample_id'].tolist()[:8]}")
    if len(ends) and ends[-1] > n_tokens:
        out.append(f"{name}: samples end at token {ends[-1]} beyond the committed {n_tokens}")
    if manifest.get("complete") and (ends[-1] if len(ends) else 0) != n_tokens:
        out.append(
            f"{name}: complete store has {n_tokens} tokens but samples cover {ends[-1] if len(ends) else 0}"
        )
    long = samples[(samples["length"] > cache.meta.max_length) | (samples["length"] < 1)]
    if len(long):
        out.append(f"{name}: samples {long['sample_id'].tolist()[:8]} have lengths outside 1..max_length")
    rank = int(manifest["rank"])
    for sid in samples["sample_id"].tolist():
        if sid in seen:
            out.append(f"{name}: sample {sid} also in {seen[sid]}")
        seen[sid] = name
        if sid % cache.meta.world_size != rank:
            out.append(f"{name}: sample {sid} does not belong to rank {rank}")
    return out


def _check_arrays(
    cache: Cache, name: str, manifest: dict[str, Any], samples: Any, group: Any
) -> tuple[list[str], dict[str, np.ndarray]]:
    """Every array's shape and every committed shard's checksum, read through Zarr; also returns the committed
    input_ids, loss_mask and topk_ids (zeros where a shard is unreadable) for `_verify_values`."""
    out: list[str] = []
    n_tokens = int(manifest["committed_tokens"])
    covered = 0
    data: dict[str, np.ndarray] = {}
    for array, (dtype, inner) in cache.specs.items():
        try:
            arr = _read(cache, partial(group.__getitem__, array))
        except StoreUnreachable:
            raise
        except Exception as err:  # missing (KeyError) or damaged zarr.json (several types)
            out.append(f"{name}: array {array} missing or unreadable ({type(err).__name__})")
            continue
        if arr.shape[0] < n_tokens or tuple(arr.shape[1:]) != inner or arr.dtype != np.dtype(dtype):
            out.append(
                f"{name}: array {array} has shape {arr.shape} {arr.dtype}, expected "
                f"[>={n_tokens}, {', '.join(map(str, inner))}] {dtype}"
            )
            continue
        parts = []
        for shard in manifest["shards"]:
            parts.append(
                _read_shard(_Store(cache, name, samples, out), _Array(arr, array, dtype, inner), shard)
            )
            covered = max(covered, int(shard["stop"]))
        if array in ("input_ids", "loss_mask", "topk_ids"):
            data[array] = np.concatenate(parts) if parts else np.zeros((0, *inner), dtype=dtype)
    if covered != n_tokens:
        out.append(f"{name}: manifest shards cover {covered} tokens, committed {n_tokens}")
    return out, data


class _Store(NamedTuple):
    """The store being checked: its cache, its name, its samples table, and the list its problems go to."""

    cache: Cache
    name: str
    samples: Any
    out: list[str]


class _Array(NamedTuple):
    """One array of the store, opened: the Zarr array, its name, dtype and per-token shape."""

    arr: Any
    name: str
    dtype: str
    inner: tuple[int, ...]


def _read_shard(store: _Store, opened: _Array, shard: dict[str, Any]) -> np.ndarray:
    """The rows of one committed shard of an array, checked against the manifest checksum (problems go to
    `store.out`); zeros when the shard cannot be decoded."""
    cache, name, samples, out = store
    arr, array, dtype, inner = opened
    start, stop = int(shard["start"]), int(shard["stop"])
    key = shard_key(array, int(shard["index"]), inner)
    if not _read(cache, partial(cache._root.exists, f"{layout.STORES_DIR}/{name}/{key}")):
        out.append(f"{name}: shard file {key} is missing; affects {_samples_in(samples, start, stop)}")
        return np.zeros((stop - start, *inner), dtype=dtype)
    try:
        values = np.asarray(_read(cache, lambda: arr[start:stop]))
    except StoreUnreachable:
        raise
    except Exception as err:  # a damaged shard: zarr raises codec/crc errors of several types
        out.append(
            f"{name}: {array} shard {shard['index']} unreadable ({type(err).__name__}); "
            f"affects {_samples_in(samples, start, stop)}"
        )
        return np.zeros((stop - start, *inner), dtype=dtype)
    if layout.checksum(values) != shard["checksums"].get(array):
        out.append(
            f"{name}: {array} shard {shard['index']} (tokens {start}..{stop}) fails its "
            f"checksum; affects {_samples_in(samples, start, stop)}"
        )
    return values


def _verify_values(
    cache: Cache,
    name: str,
    samples: Any,
    data: dict[str, np.ndarray],
    ahead: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    out: list[str] = []
    V = cache.meta.vocab_size
    ids, mask, topk = data.get("input_ids"), data.get("loss_mask"), data.get("topk_ids")
    if ids is None or mask is None:
        return out
    if len(ids) and (ids.min() < 0 or ids.max() >= V):
        out.append(f"{name}: input_ids outside 0..{V - 1}")
    if topk is not None and topk.size and (topk.min() < 0 or topk.max() >= V):
        out.append(f"{name}: topk_ids outside 0..{V - 1}")
    counts = np.zeros(V, dtype=np.int64)
    all_counts = np.zeros(V, dtype=np.int64)
    wrong = []
    for sid, off, n, sup in samples[["sample_id", "offset", "length", "num_supervised"]].itertuples(
        index=False
    ):
        m = mask[off : off + n]
        if int(m.sum()) != int(sup):
            wrong.append(int(sid))
        counts += np.bincount(np.clip(ids[off : off + n][m], 0, V - 1), minlength=V)
        all_counts += np.bincount(np.clip(ids[off : off + n], 0, V - 1), minlength=V)
    if wrong:
        out.append(f"{name}: num_supervised disagrees with loss_mask for samples {wrong[:8]}")
    out += _check_counts(
        cache, name, layout.TOKEN_COUNTS, counts, layout.TOKEN_COUNTS in ahead, "supervised "
    )
    if layout.ALL_TOKEN_COUNTS in (cache.manifests.get(name) or {}).get("tables", {}):
        out += _check_counts(
            cache, name, layout.ALL_TOKEN_COUNTS, all_counts, layout.ALL_TOKEN_COUNTS in ahead, ""
        )
    return out


def _check_counts(
    cache: Cache, name: str, table: str, counts: np.ndarray, is_ahead: bool, what: str
) -> list[str]:
    """A counts table against the committed samples; one written by a later commit may only count more."""
    try:
        blob = _read(cache, lambda: cache._root.read_bytes(f"{layout.STORES_DIR}/{name}/{table}"))
        stored = np.load(io.BytesIO(blob))
    except StoreUnreachable:
        raise
    except Exception:  # missing, truncated or damaged .npy
        return [f"{name}: {table} missing or unreadable"]
    if is_ahead:  # a later commit's counts: they include every committed sample, plus more
        if stored.shape != counts.shape or bool((stored < counts).any()):
            return [f"{name}: {table} counts fewer tokens than its committed samples hold"]
    elif not np.array_equal(stored, counts):
        return [f"{name}: {table} disagrees with the {what}tokens of its samples"]
    return []


# ------------------------------------------------------------------------------------------------- target/
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a tokenizer
_HEADER_MAX = 100 << 20  # a safetensors header larger than this is damage, not a header


def verify_target(cache: Cache) -> list[str]:
    """target/: config.json (JSON), a tokenizer file, and pieces.safetensors whole (its header names the pieces,
    its tensors fit in the file). A missing file is named as missing."""
    from peagle_pipeline.cache.reader import missing_target_file

    root, rel = cache._root, layout.TARGET_DIR
    config = f"{rel}/config.json"
    if not _read(cache, partial(root.exists, config)):
        return [missing_target_file(cache.path, config)]
    out: list[str] = []
    try:
        if not isinstance(json.loads(_read(cache, partial(root.read_bytes, config))), dict):
            raise ValueError(config)
    except StoreUnreachable:
        raise
    except Exception:
        out.append(f"{config} is damaged (not a JSON object); training reads it")
    if not any(_read(cache, partial(root.exists, f"{rel}/{name}")) for name in _TOKENIZER_FILES):
        out.append(missing_target_file(cache.path, f"{rel}/{' or '.join(_TOKENIZER_FILES)}"))
    pieces = f"{rel}/{layout.PIECES_FILE}"
    if not _read(cache, partial(root.exists, pieces)):
        return [*out, missing_target_file(cache.path, pieces)]
    problem = _pieces_problem(cache, pieces)
    return out + ([f"{pieces} is damaged ({problem}); training reads it"] if problem else [])


def _pieces_problem(cache: Cache, rel: str) -> str | None:
    """What is wrong with pieces.safetensors (read: its header and size only), or None."""
    try:
        size = _read(cache, partial(cache._root.size, rel))
        (n,) = struct.unpack("<Q", _read(cache, partial(_read_head, cache, rel, 8))) if size >= 8 else (-1,)
        if not 0 < n <= min(size - 8, _HEADER_MAX):
            return "truncated header"
        header = json.loads(_read(cache, partial(_read_head, cache, rel, 8 + n))[8:])
    except StoreUnreachable:
        raise
    except Exception as err:
        return f"unreadable header ({type(err).__name__})"
    missing = [k for k in layout.PIECE_KEYS if k not in header]
    if missing:
        return f"lacks {', '.join(missing)}"
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"truncated: {size} bytes of {8 + n + end}"
    return None


def _read_head(cache: Cache, rel: str, n: int) -> bytes:
    """The first `n` bytes of file `rel` of the cache."""
    root = cache._root
    if root.local is not None:
        with open(root.local / rel, "rb") as f:
            return f.read(n)
    with root.fs.open(f"{root.base}/{rel}", "rb") as f:
        return bytes(f.read(n))
