"""Read-only access to an extraction cache: metadata, per-sample tables, sample tensors, summaries, verification.

Only what the manifests commit is visible. Sample reads go through one `StoreReader` per store (store_reader.py:
a pread fast path on local disk, Zarr's store layer for fsspec URLs), opened lazily per process, so a `Cache` may be
handed to DataLoader workers (fork or spawn). Never writes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.store_reader import StoreReader, StoreRoot
from peagle_pipeline.errors import BadInput, CorruptCache, IncompatibleCache

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from peagle_pipeline.core.vocab import TokenizerFacts

__all__ = ["VERIFY_ADVICE", "missing_target_file", "SampleArrays", "Cache", "open_cache", "prompt_length"]

# Token rows read at once by `Cache.prompt_keys` (input_ids and loss_mask: 5 bytes a token, so about 80 MB).
_KEY_WINDOW_TOKENS = 1 << 24


def prompt_length(loss_mask: np.ndarray) -> int:
    """A sample's prompt length: the tokens before its first supervised one (0 when it has none).

    Example: loss_mask [0, 0, 0, 1, 1, 0, 1] -> 3.
    """
    hits = np.flatnonzero(np.asarray(loss_mask))
    return int(hits[0]) if len(hits) else 0


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


class Cache:
    """An opened cache (read-only). See `open_cache`."""

    def __init__(self, root: StoreRoot, meta: CacheMeta, manifests: dict[str, dict[str, Any] | None]) -> None:
        import pandas as pd

        self._root = root
        self.meta = meta
        self.path = root.url
        self.manifests = manifests
        self.specs = layout.array_specs(meta)
        self._stores: dict[str, StoreReader] = {}
        frames, rejects = [], []
        for name, manifest in manifests.items():
            if manifest is None:
                continue
            try:
                if CacheMeta.from_dict(manifest["meta"]).differences(meta):
                    raise CorruptCache(f"store {name}: its manifest disagrees with {layout.CACHE_META}")
                self._stores[name] = StoreReader(root, name, manifest, self.specs)
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
                    f"store {name} of {root.url} is damaged ({type(err).__name__}){VERIFY_ADVICE}"
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
        """Local directory of the target's config.json and tokenizer files (of a remote cache: a local copy of its
        target/ in a temporary directory, made once per process)."""
        if self._root.local is None:
            return self._root.local_copy(layout.TARGET_DIR)
        return self._root.local / layout.TARGET_DIR

    def target_config(self) -> dict[str, Any]:
        """The target's config.json as copied into target/ (CorruptCache when missing or not JSON)."""
        rel = f"{layout.TARGET_DIR}/config.json"
        try:
            return json.loads(self._root.read_bytes(rel))
        except FileNotFoundError:
            raise CorruptCache(missing_target_file(self.path, rel)) from None
        except ValueError:
            raise CorruptCache(f"{self.path}/{rel} is damaged (not JSON){VERIFY_ADVICE}") from None

    def target_pieces(self) -> dict[str, torch.Tensor]:
        """The target's embed_tokens.weight [V, H], lm_head.weight [V, H], norm.weight [H] (keys layout.PIECE_KEYS),
        in the draft's convention (`core.target_convention`: a zero-centred norm as 1 + w)."""
        from peagle_pipeline.core.target_convention import pieces_in_draft_convention

        pieces = self._read_pieces(lambda key: key in layout.PIECE_KEYS)
        missing = [k for k in layout.PIECE_KEYS if k not in pieces]
        if missing:
            raise IncompatibleCache(f"{self.path}: target pieces lack {', '.join(missing)}")
        return pieces_in_draft_convention({k: pieces[k] for k in layout.PIECE_KEYS}, self.target_config())

    def target_layer(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(index, tensors keyed by Llama names) of the target decoder layer stored for starting a draft from it
        (`core/target_init.py`), in the draft's convention (`core.target_convention`), or None: a cache written
        before it was stored, or a target whose checkpoint does not name its layers the Llama way."""
        from peagle_pipeline.core.target_convention import layer_in_draft_convention

        prefix = layout.LAYER_PIECE_PREFIX
        pieces = self._read_pieces(lambda key: key.startswith(prefix) or key == layout.LAYER_INDEX_KEY)
        tensors = {k[len(prefix) :]: v for k, v in pieces.items() if k.startswith(prefix)}
        if layout.LAYER_INDEX_KEY not in pieces or not tensors:
            return None
        return int(pieces[layout.LAYER_INDEX_KEY][0]), layer_in_draft_convention(
            tensors, self.target_config()
        )

    def _read_pieces(self, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """The tensors of target/pieces.safetensors whose keys `wanted` accepts, and only those (the embedding
        and LM head are gigabytes for a large vocabulary: the layer alone is not read with them)."""
        from safetensors import safe_open

        path = self.target_dir / layout.PIECES_FILE
        if not path.is_file():  # (safetensors' own error names no errno: it would end as a traceback)
            raise CorruptCache(missing_target_file(self.path, f"{layout.TARGET_DIR}/{layout.PIECES_FILE}"))
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys() if wanted(key)}

    def token_counts(self) -> np.ndarray:
        """int64 [V]: how often each token id is a supervised token, summed over all stores."""
        return self._sum_counts(layout.TOKEN_COUNTS)

    def all_token_counts(self) -> np.ndarray:
        """int64 [V]: how often each token id occurs at all (context or supervised), summed over all stores.

        Caches written before this table existed are recounted from their `input_ids`.
        """
        return self._sum_counts(layout.ALL_TOKEN_COUNTS)

    def _sum_counts(self, table: str) -> np.ndarray:
        total = np.zeros(self.meta.vocab_size, dtype=np.int64)
        for name in self._stores:
            manifest = self.manifests[name] or {}
            if table not in manifest.get("tables", {}) and table == layout.ALL_TOKEN_COUNTS:
                total += self._recount_all(name, manifest)
                continue
            try:
                raw = self._root.read_bytes(f"{layout.STORES_DIR}/{name}/{table}")
            except FileNotFoundError:
                raise CorruptCache(f"store {name}: {table} is missing") from None
            _check_table(name, manifest, table, raw)
            try:
                counts = np.load(io.BytesIO(raw), allow_pickle=False).astype(np.int64)
                total += counts.reshape(self.meta.vocab_size)
            except (ValueError, OSError, EOFError) as err:
                raise CorruptCache(f"store {name}: {table} is damaged ({type(err).__name__})") from None
        return total

    def _recount_all(self, name: str, manifest: dict[str, Any]) -> np.ndarray:
        """Every committed token of one store counted from its `input_ids` (caches older than the table)."""
        rows = self.samples[self.samples["store"] == name]
        end = int((rows["offset"] + rows["length"]).max()) if len(rows) else 0
        ids = self._stores[name].read("input_ids", 0, end) if end else np.zeros(0, dtype=np.int64)
        return np.bincount(ids.astype(np.int64), minlength=self.meta.vocab_size)

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
        """(store name, offset, length) of a sample; BadInput if the cache has no such sample (naming the reject
        reason when extraction rejected that row)."""
        i = int(np.searchsorted(self._ids, sample_id))
        if i >= len(self._ids) or self._ids[i] != sample_id:
            rejected = self.rejects[self.rejects["sample_id"] == sample_id]
            if len(rejected):
                r = rejected.iloc[0]
                raise BadInput(
                    f"sample {sample_id} was rejected at extraction ({r['source']} row {r['source_row']}): "
                    f"{r['reason']}"
                )
            raise BadInput(f"sample {sample_id} is not in cache {self.path}")
        return self._store_names[self._store_of[i]], int(self._offsets[i]), int(self._lengths[i])

    def read_arrays(self, sample_id: int, fast: bool = True) -> dict[str, np.ndarray]:
        """A sample's arrays in their stored numpy dtypes (fast=False reads through zarr)."""
        store, offset, length = self.locate(sample_id)
        reader = self._stores[store]
        if not fast:
            return {name: reader.read(name, offset, offset + length, fast=False) for name in self.specs}
        reader.prefetch(offset, offset + length)
        return reader.read_many(list(self.specs), offset, offset + length)

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
            topk_logprobs=torch.from_numpy(a["topk_logprobs"].astype(np.float32, copy=False)),
            last_hidden=layout.from_storage(a["last_hidden"], dtype) if "last_hidden" in a else None,
        )

    def prompt_keys(self, sample_ids: np.ndarray) -> list[bytes | None]:
        """A digest of each sample's prompt (its token ids before its first supervised token; `prompt_length`),
        or None for a sample without one. Samples drawn from one prompt (several replies generated per prompt, or
        the same conversation in two caches) share a digest.

        Reads only input_ids and loss_mask, a window of consecutive token rows per store at a time. A sample whose
        rows cannot be read (CorruptCache) gets None: reading it for training says so, or skips it (skip_corrupt).
        """
        located = [self.locate(int(i)) for i in sample_ids]
        keys: list[bytes | None] = [None] * len(located)
        order = sorted(range(len(located)), key=lambda k: (located[k][0], located[k][1]))
        window: list[int] = []
        for k in [*order, None]:
            if window and (
                k is None
                or located[k][0] != located[window[0]][0]
                or located[k][1] + located[k][2] - located[window[0]][1] > _KEY_WINDOW_TOKENS
            ):
                self._key_window(window, located, keys)
                window = []
            if k is not None:
                window.append(k)
        return keys

    def _key_window(
        self, window: list[int], located: list[tuple[str, int, int]], keys: list[bytes | None]
    ) -> None:
        store, lo = located[window[0]][0], located[window[0]][1]
        hi = max(located[k][1] + located[k][2] for k in window)
        try:
            rows = self._stores[store].read_many(["input_ids", "loss_mask"], lo, hi)
        except CorruptCache:
            if len(window) > 1:  # find the damaged samples one by one; the others keep their keys
                for k in window:
                    self._key_window([k], located, keys)
            return
        for k in window:
            start, length = located[k][1] - lo, located[k][2]
            n = prompt_length(rows["loss_mask"][start : start + length])
            if n:
                ids = rows["input_ids"][start : start + n].astype(np.int64)
                keys[k] = hashlib.blake2b(ids.tobytes(), digest_size=16).digest()

    def tokenizer_facts(self) -> TokenizerFacts | None:
        """What training needs of the tokenizer (target/tokenizer_facts.json), or None for a cache written before
        extraction kept them, or with that file unreadable (then use `tokenizer()`)."""
        from peagle_pipeline.cache.target import parse_tokenizer_facts

        rel = f"{layout.TARGET_DIR}/{layout.TOKENIZER_FACTS}"
        return parse_tokenizer_facts(self._root.read_bytes(rel)) if self._root.exists(rel) else None

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
                "token": [tok.decode([int(i)], clean_up_tokenization_spaces=False) for i in ids],
                "loss_mask": a["loss_mask"],
                "top1_token": [tok.decode([int(i)], clean_up_tokenization_spaces=False) for i in top1],
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


VERIFY_ADVICE = "; run `peagle-pipeline verify` on it for every problem it has"
"""The end of a reader's error about damage it found: verify reports all of it (never said by verify itself)."""


def missing_target_file(cache: str, rel: str) -> str:
    """The one line for a file of target/ that is missing: what it is, and how extract writes it again (target/ is
    written whenever it is absent, from --model)."""
    return (
        f"{cache}: {rel} is missing (the target's files training needs); remove {cache}/{layout.TARGET_DIR} and "
        "re-run the extract command that wrote the cache: it writes target/ again from the model"
    )


def _check_table(store: str, manifest: dict[str, Any], table: str, blob: bytes) -> None:
    """A complete store's tables never change after its last commit: a hash mismatch is damage.

    (An incomplete store's table may legitimately run ahead of its manifest while a writer commits.)
    """
    if manifest.get("complete") and layout.file_hash(blob) != manifest.get("tables", {}).get(table):
        raise CorruptCache(f"store {store}: {table} does not match its manifest checksum{VERIFY_ADVICE}")


def _read_json(root: StoreRoot, rel: str) -> dict[str, Any] | None:
    try:
        data = json.loads(root.read_bytes(rel))
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: the "cache" path is a file
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
    root = StoreRoot(path)
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
