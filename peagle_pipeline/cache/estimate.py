"""How many bytes a cache of given settings takes on disk: per token (what grows with the data) and fixed (the
target/ pieces, the per-store count tables, the per-sample rows). Pure arithmetic over `layout.array_specs`.

Compressed arrays are sized with the ratios measured on real caches (SmolLM2-135M on ShareGPT and the tiny test
targets; `COMPRESSED` below): they change with the target and the data, but hidden states, which are stored raw
under `compress: auto`, are nearly all of a real target's bytes (97 % for H = 576, 99.5 % for H = 4096), so the
estimate moves with them. Example: SmolLM2-135M (H = 576, 3 aux layers, top-32, bf16, auto) -> 3,456 bytes of aux
states + about 110 for the rest, 3,566 bytes a token; nf4 -> 978 + 110 = 1,088.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta

__all__ = ["CacheShape", "bytes_per_token", "fixed_bytes", "pieces_bytes", "COMPRESSED"]

# Stored bytes over raw bytes of each array per `compress` setting (auto: zstd for ids, mask and log-probs, blosc
# for top-k ids, hidden states raw; zstd: level 3 everywhere). Measured on SmolLM2-135M's cache of ShareGPT.
COMPRESSED: dict[str, dict[str, float]] = {
    "auto": {"input_ids": 0.63, "loss_mask": 0.34, "topk_ids": 0.50, "topk_logprobs": 0.67},
    "zstd": {"input_ids": 0.63, "loss_mask": 0.34, "topk_ids": 0.50, "topk_logprobs": 0.67,
             "aux_hidden": 0.80, "last_hidden": 0.80},
}  # fmt: skip
# Packed lossy rows (fp8, nf4: scaled codes) barely compress under zstd.
_PACKED_ZSTD = 0.97
CRC_BYTES = 4  # per inner chunk of a checksummed array (crc32c trailer)
INDEX_ENTRY_BYTES = layout.SHARD_INDEX_ENTRY  # per inner chunk, in its shard's index
SAMPLE_ROW_BYTES = 48  # samples.parquet per sample (compressed columns)


@dataclass(frozen=True, slots=True)
class CacheShape:
    """What a cache's size depends on, besides the data: `CacheMeta`'s fields of the same names."""

    hidden_size: int
    n_aux: int
    hidden_dtype: str  # logical: "bfloat16", "float32", "float8_e4m3", "nf4"
    topk: int
    vocab_size: int
    has_last_hidden: bool = False
    compress: str = "auto"
    chunk_tokens: int = 128

    @classmethod
    def of(cls, meta: CacheMeta) -> CacheShape:
        return cls(
            meta.hidden_size, len(meta.aux_layer_ids), meta.hidden_dtype, meta.topk, meta.vocab_size,
            meta.has_last_hidden, meta.compress, meta.chunk_tokens,
        )  # fmt: skip


def _meta(shape: CacheShape) -> CacheMeta:
    """A CacheMeta with `shape`'s sizes (the rest placeholders), to ask `layout.array_specs` for the arrays."""
    return CacheMeta(
        target_name_or_path="", target_architectures=[], target_config_sha256="", tokenizer_sha256="",
        chat_template_sha256="", num_hidden_layers=max(shape.n_aux, 1), hidden_size=shape.hidden_size,
        vocab_size=shape.vocab_size, aux_layer_ids=list(range(shape.n_aux)), topk=shape.topk,
        hidden_dtype=shape.hidden_dtype, compute_dtype="bfloat16", has_last_hidden=shape.has_last_hidden,
        max_length=1, overlong="truncate", assistant_turns="all", leading_assistant="context",
        dataset_fingerprint="", max_samples=None, world_size=1, shard_tokens=shape.chunk_tokens,
        chunk_tokens=shape.chunk_tokens, compress=shape.compress, length_window=1,
    )  # fmt: skip


def bytes_per_token(shape: CacheShape) -> dict[str, float]:
    """Stored bytes per token of each array (chunk trailers and shard index entries included).

    Raises:
        ValueError: a hidden dtype `layout` does not know, or a hidden size it cannot pack.
    """
    import numpy as np

    out: dict[str, float] = {}
    for name, (dtype, inner) in layout.array_specs(_meta(shape)).items():
        raw = np.dtype(dtype).itemsize * math.prod(inner)
        ratio = COMPRESSED.get(shape.compress, {}).get(name, 1.0)
        if shape.compress == "zstd" and name in layout.HIDDEN_ARRAYS and dtype == "uint8":
            ratio = _PACKED_ZSTD
        trailer = CRC_BYTES if layout.chunk_codec(name, shape.compress) in ("crc32c", "blosc") else 0
        out[name] = raw * ratio + (trailer + INDEX_ENTRY_BYTES) / shape.chunk_tokens
    return out


def fixed_bytes(shape: CacheShape, stores: int, samples: int) -> float:
    """Bytes that do not grow with tokens: per store its count tables (two int64 [V]), zarr.json files and the
    padding of each array's last inner chunk to chunk_tokens rows (half a chunk on average); per sample its
    samples.parquet row."""
    half_chunk = sum(bytes_per_token(shape).values()) * shape.chunk_tokens / 2
    per_store = 2 * 8 * shape.vocab_size + 8_000 + half_chunk
    return stores * per_store + samples * SAMPLE_ROW_BYTES


def pieces_bytes(config: dict[str, Any], init_layer: bool = True) -> int:
    """Bytes of target/pieces.safetensors from a target's (text) config: embedding and lm_head (a copy when tied)
    [V, H], the final norm [H], and a Llama-shaped decoder layer when `init_layer` (attention projections, a gated
    MLP of intermediate_size, two norms), in the config's dtype (2 bytes unless float32)."""
    H, V = int(config["hidden_size"]), int(config["vocab_size"])
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    size = 4 if dtype in ("float32", "fp32") else 2
    params = 2 * V * H + H
    if init_layer:
        heads = int(config.get("num_attention_heads") or 1)
        head_dim = int(config.get("head_dim") or H // heads)
        kv = int(config.get("num_key_value_heads") or heads)
        inter = int(config.get("intermediate_size") or 0)
        params += 2 * H * heads * head_dim + 2 * H * kv * head_dim + 3 * H * inter + 2 * H
    return params * size
