"""The cache contract in one file: format version, file and array names, dtypes and metadata.

Layout of a cache directory (see docs/reference/cache-format.md, which mirrors this file):

    CACHE/
      cache.json                       CacheMeta (written once, atomically, by the first writer)
      extract.yaml                     the resolved extract settings of the first writer
      target/                          what training needs from the target (never the full model)
        config.json, tokenizer files, pieces.safetensors (embed_tokens.weight, lm_head.weight, norm.weight),
        tokenizer_facts.json             what training needs of the tokenizer (core.vocab.TokenizerFacts)
      stores/
        rank-00000-of-00002.zarr/      one Zarr v3 group per writer rank, flat token axis
          zarr.json, input_ids/, loss_mask/, aux_hidden/, topk_ids/, topk_logprobs/, [last_hidden/]
          samples.parquet              committed samples of this store (offset, length, ...)
          rejects.parquet              rows this rank rejected, with reasons
          token_counts.npy             int64 [V] counts of supervised tokens
          all_token_counts.npy         int64 [V] counts of every token (supervised or not; mask-token rule)
          manifest.json                commit record, written last: the only truth readers trust
        rank-00000-of-00002.lock       flock held by the live writer of that rank

Pure: no I/O beyond small path helpers; safe to import anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from peagle_pipeline.core import fp8, nf4
from peagle_pipeline.core.settings import setting_differences

__all__ = [
    "FORMAT_VERSION",
    "CACHE_META",
    "EXTRACT_YAML",
    "TARGET_DIR",
    "PIECES_FILE",
    "TOKENIZER_FACTS",
    "STORES_DIR",
    "MANIFEST",
    "SAMPLES_TABLE",
    "REJECTS_TABLE",
    "TOKEN_COUNTS",
    "ALL_TOKEN_COUNTS",
    "ARRAYS",
    "PIECE_KEYS",
    "LAYER_PIECE_PREFIX",
    "LAYER_INDEX_KEY",
    "SAMPLE_COLUMNS",
    "REJECT_COLUMNS",
    "CacheMeta",
    "store_name",
    "lock_name",
    "to_storage",
    "from_storage",
    "array_specs",
    "HASH",
    "checksum",
    "file_hash",
    "SHARD_INDEX_ENTRY",
    "HIDDEN_ARRAYS",
    "FP8",
    "NF4",
    "zstd_level",
    "chunk_codec",
]

FORMAT_VERSION = 1

CACHE_META = "cache.json"
EXTRACT_YAML = "extract.yaml"
TARGET_DIR = "target"
PIECES_FILE = "pieces.safetensors"
# absent in caches written before it existed: training then loads the tokenizer
TOKENIZER_FACTS = "tokenizer_facts.json"
STORES_DIR = "stores"
MANIFEST = "manifest.json"
SAMPLES_TABLE = "samples.parquet"
REJECTS_TABLE = "rejects.parquet"
TOKEN_COUNTS = "token_counts.npy"
ALL_TOKEN_COUNTS = "all_token_counts.npy"  # absent in caches written before it existed: readers recount

# Array name -> stored numpy dtype for the default (bf16) extraction. Shapes: N = tokens in the store.
ARRAYS: dict[str, str] = {
    "input_ids": "int32",  # [N]
    "loss_mask": "bool",  # [N] True where x_t is a supervised assistant token
    "aux_hidden": "uint16",  # [N, n_aux, H] bf16 bit patterns (float32 when extracted in fp32)
    "topk_ids": "int32",  # [N, k] ids of the target's top-k next-token candidates, descending
    "topk_logprobs": "float16",  # [N, k] true log-probs (log-softmax over the full vocab, fp32 before storage)
    "last_hidden": "uint16",  # [N, H] optional pre-norm output of the last layer (layer id L)
}

# Tensor names inside target/pieces.safetensors.
PIECE_KEYS = ("embed_tokens.weight", "lm_head.weight", "norm.weight")
# Optional, same file: one decoder layer of the target, to start a draft's fused layer from (`train
# --init-from-target`): LAYER_PIECE_PREFIX + a Llama layer's tensor name (`self_attn.q_proj.weight`, ...), its
# index as the int64 [1] tensor LAYER_INDEX_KEY (a tensor, not metadata: safetensors writes metadata keys in an
# order that changes from process to process, and the file must be byte-identical). Older caches have none.
LAYER_PIECE_PREFIX = "init_layer."
LAYER_INDEX_KEY = "init_layer_index"

# Per-sample table (samples.parquet) and reject table (rejects.parquet) columns.
SAMPLE_COLUMNS = (
    "sample_id",
    "source",
    "source_row",
    "store",
    "offset",
    "length",
    "num_supervised",
    "truncated",
)
REJECT_COLUMNS = ("sample_id", "source", "source_row", "store", "reason")


@dataclass(frozen=True, kw_only=True)
class CacheMeta:
    """Everything training and resuming depend on. Two extractions may share a cache only if equal."""

    format_version: int = FORMAT_VERSION
    target_name_or_path: str
    target_architectures: list[str]
    target_config_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    topk: int
    # "bfloat16" or "float32" (lossless), or "float8_e4m3" (lossy opt-in, core/fp8.py: e4m3 + an fp32 scale per
    # token and layer), or "nf4" (lossy opt-in, core/nf4.py: 4-bit NF4 codes in blocks of 32 with e4m3 block
    # scales, 4 bf16 outliers per token and layer), both read back as bfloat16: how aux_hidden / last_hidden are
    # stored
    hidden_dtype: str
    # "bfloat16" or "float32": the dtype the target forward ran in (resolved, never "auto"). Caches written before
    # this field existed computed in their hidden_dtype, which `from_dict` fills in, so they resume unchanged.
    compute_dtype: str
    has_last_hidden: bool
    max_length: int
    overlong: str
    assistant_turns: str
    leading_assistant: str
    dataset_fingerprint: str
    max_samples: int | None
    world_size: int
    shard_tokens: int
    chunk_tokens: int
    compress: str
    # Samples sorted by length in windows of this many before batching (`stages/extract/batch_plan.sort_by_length`): the storage
    # order. Caches written before this field existed stored samples in row order, which `from_dict` reads as 1.
    length_window: int
    # Extra chat-template variables the rows were rendered with (`extract --chat-template-kwargs`); caches written
    # before this field existed were rendered without any, which `from_dict` fills in.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheMeta:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values.setdefault("compute_dtype", values.get("hidden_dtype"))
        values.setdefault("length_window", 1)
        return cls(**values)

    def differences(self, other: CacheMeta) -> list[str]:
        """Names of the settings that differ (empty when compatible)."""
        found = setting_differences(self.to_dict(), other.to_dict(), ignore={"extra"})
        return [name for name, _, _ in found]

    def target_differences(self, other: CacheMeta) -> list[str]:
        """Names of the settings that make `other` hold another target's states (empty when a draft trained on one
        cache can be evaluated on the other: same model, tokenizer and aux layers)."""
        a, b = self.to_dict(), other.to_dict()
        return [k for k in SAME_TARGET_FIELDS if a.get(k) != b.get(k)]


# What two caches must share for a draft trained on one to be evaluated on the other (`CacheMeta.target_differences`).
SAME_TARGET_FIELDS = (
    "target_config_sha256",
    "tokenizer_sha256",
    "aux_layer_ids",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
)

# Per-shard checksums in manifest.json: blake2b-128 of the decoded C-order bytes of each array's rows in the shard.
HASH = "blake2b-128"
# Zarr sharding codec index (at the end of every shard file): per inner chunk (offset, nbytes) as little-endian
# uint64, then a crc32c of those bytes. An absent chunk is (2**64-1, 2**64-1).
SHARD_INDEX_ENTRY = 16


FP8 = "float8_e4m3"
NF4 = "nf4"
# Logical hidden dtype -> stored numpy dtype (Zarr has neither bfloat16 nor float8: both are stored as bits; nf4
# rows are packed bytes).
_HIDDEN_STORED = {"bfloat16": "uint16", "float32": "float32", FP8: "uint8", NF4: "uint8"}
# The packed row width of each lossy dtype, from the hidden size.
_PACKED_WIDTH = {FP8: fp8.packed_width, NF4: nf4.packed_width}


def array_specs(meta: CacheMeta) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Arrays of a store with their stored dtype and per-token shape (the shape after the token axis).

    Example: SmolLM2 (H=576), 3 aux layers, k=32, bf16 -> aux_hidden ("uint16", (3, 576)), topk_ids ("int32", (32,));
    fp8 -> aux_hidden ("uint8", (3, 580)); nf4 -> aux_hidden ("uint8", (3, 326)).

    Raises:
        ValueError: a hidden dtype this version does not know (a cache from a newer version), or a hidden size
            nf4 cannot pack (not a multiple of 32).
    """
    if meta.hidden_dtype not in _HIDDEN_STORED:
        raise ValueError(f"unknown hidden dtype {meta.hidden_dtype!r}")
    hidden, H = _HIDDEN_STORED[meta.hidden_dtype], meta.hidden_size
    if meta.hidden_dtype in _PACKED_WIDTH:
        H = _PACKED_WIDTH[meta.hidden_dtype](H)  # bytes per packed row (core/fp8.py, core/nf4.py)
    specs: dict[str, tuple[str, tuple[int, ...]]] = {
        "input_ids": (ARRAYS["input_ids"], ()),
        "loss_mask": (ARRAYS["loss_mask"], ()),
        "aux_hidden": (hidden, (len(meta.aux_layer_ids), H)),
        "topk_ids": (ARRAYS["topk_ids"], (meta.topk,)),
        "topk_logprobs": (ARRAYS["topk_logprobs"], (meta.topk,)),
    }
    if meta.has_last_hidden:
        specs["last_hidden"] = (hidden, (H,))
    return specs


HIDDEN_ARRAYS = ("aux_hidden", "last_hidden")


def zstd_level(name: str, compress: str) -> int | None:
    """zstd level of array `name` under the `compress` setting, None = not zstd-compressed.

    auto: level 3 for input ids, loss mask and top-k log-probs; top-k ids use blosc (`chunk_codec`); hidden states
    are stored raw with a crc32c per inner chunk, since their bf16 bytes barely compress (~0.8x at level 3) and raw
    chunks read at memcpy speed. zstd: level 3 everywhere. none: raw, no per-chunk checksum (only the manifest's
    shard checksums).
    """
    if compress == "zstd" or (compress == "auto" and chunk_codec(name, compress) == "zstd"):
        return 3
    return None


def chunk_codec(name: str, compress: str) -> str:
    """The bytes-to-bytes codecs of an inner chunk, by name:
    "zstd" (level 3, frame checksum), "blosc" (lz4 over byte-shuffled values, then crc32c), "crc32c" (raw + crc32c)
    or "none". Under auto, top-k ids take blosc: small integers compress as well with a byte shuffle + lz4 as with
    zstd (~0.5x) but decode ~5x faster, which is most of a random sample read's decode time."""
    if compress == "zstd":
        return "zstd"
    if compress == "none":
        return "none"
    if name in HIDDEN_ARRAYS:
        return "crc32c"
    return "blosc" if name == "topk_ids" else "zstd"


def file_hash(data: bytes | memoryview) -> str:
    """blake2b-128 hex digest of bytes: the manifest's checksum of a table file (and of array bytes, `checksum`)."""
    import hashlib

    return hashlib.blake2b(data, digest_size=16).hexdigest()


def checksum(array: np.ndarray) -> str:
    """blake2b-128 hex digest of an array's C-order bytes (the per-shard checksum of the manifest)."""
    return file_hash(np.ascontiguousarray(array).data.cast("B"))


def store_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.zarr"


def lock_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.lock"


def to_storage(tensor: Any, logical_dtype: str) -> np.ndarray:
    """Hidden states (a torch tensor, any device and float dtype) to their stored form on the CPU: bf16 bit
    patterns as uint16 (Zarr has no bfloat16), float32, or fp8 rows (core/fp8.py), or nf4 rows (core/nf4.py,
    packed on the tensor's device: a quarter of the bytes cross to the host). The one conversion the writer's
    inputs go through.
    """
    import torch

    if logical_dtype == NF4:
        return nf4.encode_rows(tensor.detach()).to("cpu").numpy()  # [..., packed_width(H)] uint8
    t = tensor.detach().to("cpu").contiguous()
    if logical_dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.uint16).numpy()
    if logical_dtype == "float32":
        return t.to(torch.float32).numpy()
    if logical_dtype == FP8:
        return fp8.encode_rows(t).numpy()  # [..., H + 4] uint8: e4m3 bytes and an fp32 scale per row
    raise ValueError(f"unknown logical dtype {logical_dtype}")


def from_storage(array: np.ndarray, logical_dtype: str) -> Any:
    """Stored hidden states back to a torch tensor: bf16/fp32 without copying (a view); fp8 and nf4 decoded to
    bf16."""
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if logical_dtype == "bfloat16":
        return tensor.view(torch.bfloat16)
    if logical_dtype == FP8:
        return fp8.decode_rows(tensor)
    if logical_dtype == NF4:
        return nf4.decode_rows(tensor)
    return tensor
