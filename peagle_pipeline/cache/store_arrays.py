"""The Zarr v3 arrays of one store, as the cache writer creates, reopens, fills and fsyncs them (docs/reference/cache-format.md).

One array per stored field (`layout.array_specs`), sharded by `shard_tokens` rows and chunked by `chunk_tokens`;
each shard is one file `NAME/c/INDEX/0...` (one 0 per inner dimension). Codecs per array come from
`layout.chunk_codec`. Only `writer.py` calls these; readers decode shards with `shard_format.py`.

Worked example (shard_tokens 4, a commit of rows 4..11 of `input_ids` [T] and `aux_hidden` [T, n_aux, H]):
`write_rows` resizes both arrays to 12 rows and writes rows 4..11, which fill shards 1 and 2; `fsync_shards`
then fsyncs `input_ids/c/1`, `input_ids/c/2`, `aux_hidden/c/1/0/0` and `aux_hidden/c/2/0/0`, and
`shard_checksums` gives the manifest entries of shards 1 (rows 4..7) and 2 (rows 8..11).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta

if TYPE_CHECKING:
    from zarr.core.array_spec import ArrayConfigParams

__all__ = [
    "ARRAY_CONFIG",
    "shard_key",
    "create_arrays",
    "open_arrays",
    "write_rows",
    "fsync_shards",
    "shard_checksums",
]

ArraySpecs = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, inner shape), as `layout.array_specs`

# Zarr's runtime config of every array written: every chunk is stored, also one equal to the fill value (an
# all-False loss_mask chunk of a long prompt), so a shard's bytes never depend on how its chunks were written.
ARRAY_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}


def shard_key(name: str, index: int, inner: tuple[int, ...]) -> str:
    """The path of shard `index` of array `name` inside the store: `name/c/index/0...` (one 0 per inner dim)."""
    return "/".join([name, "c", str(index)] + ["0"] * len(inner))


def create_arrays(
    store_dir: Path, meta: CacheMeta, specs: ArraySpecs, rank: int, world_size: int
) -> dict[str, Any]:
    """Create the store's Zarr group and its empty arrays (0 rows each); returns them by name."""
    import zarr
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

    store_dir.parent.mkdir(parents=True, exist_ok=True)
    group = zarr.create_group(
        str(store_dir),
        zarr_format=3,
        attributes={
            "peagle_format_version": layout.FORMAT_VERSION,
            "rank": rank,
            "world_size": world_size,
        },
    )
    arrays: dict[str, Any] = {}
    for name, (dtype, inner) in specs.items():
        # zstd frame checksums / crc32c trailers let a reader detect a damaged chunk without the manifest checksum.
        codec = layout.chunk_codec(name, meta.compress)
        level = layout.zstd_level(name, meta.compress)
        compressors: Any = {
            "zstd": [ZstdCodec(level=level or 3, checksum=True)],
            "blosc": [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), Crc32cCodec()],
            "crc32c": [Crc32cCodec()],
            "none": None,
        }[codec]
        attrs: dict[str, Any] = {}
        if name in ("aux_hidden", "last_hidden"):
            attrs["logical_dtype"] = meta.hidden_dtype
            attrs["layer_ids"] = (
                list(meta.aux_layer_ids) if name == "aux_hidden" else [meta.num_hidden_layers]
            )
        arrays[name] = group.create_array(
            name,
            shape=(0, *inner),
            dtype=dtype,
            chunks=(meta.chunk_tokens, *inner),
            shards=(meta.shard_tokens, *inner),
            compressors=compressors,
            fill_value=0,
            attributes=attrs,
            config=ARRAY_CONFIG,
        )
    return arrays


def open_arrays(store_dir: Path, specs: ArraySpecs) -> dict[str, Any]:
    """Reopen an existing store's arrays for writing, after deleting the temp files of a killed Zarr write."""
    import zarr

    for partial in store_dir.rglob("*.partial"):  # zarr's temp files of a killed write
        partial.unlink(missing_ok=True)
    group = zarr.open_group(str(store_dir), mode="r+")
    # write_empty_chunks is a runtime setting, not stored in zarr.json: a resumed writer sets it again, so an
    # all-False loss_mask chunk is stored as the first run stores it (byte-identical shards either way)
    return {name: cast(Any, group[name]).with_config(ARRAY_CONFIG) for name in specs}


def write_rows(
    arrays: dict[str, Any], specs: ArraySpecs, data: dict[str, np.ndarray], start: int, stop: int
) -> None:
    """Grow every array to `stop` rows and write rows start..stop-1 from `data[name]` (its first stop - start rows)."""
    n = stop - start
    for name, arr in arrays.items():
        arr.resize((stop, *specs[name][1]))
        arr[start:stop] = data[name][:n]


def fsync_shards(store_dir: Path, specs: ArraySpecs, shard_tokens: int, start: int, stop: int) -> None:
    """fsync every shard file that rows start..stop-1 touch, of every array."""
    S = shard_tokens
    for name, (_, inner) in specs.items():
        for index in range(start // S, (stop - 1) // S + 1):
            fd = os.open(store_dir / shard_key(name, index, inner), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def shard_checksums(
    data: dict[str, np.ndarray], names: list[str], shard_tokens: int, start: int, stop: int
) -> list[dict[str, Any]]:
    """The manifest's entries of the shards rows start..stop-1 fill (`start` on a shard boundary): index, row
    range and each array's checksum of its rows there (`data[name]` row 0 = row `start`)."""
    S = shard_tokens
    shards = []
    for first in range(start, stop, S):
        last = min(first + S, stop)
        shards.append(
            {
                "index": first // S,
                "start": first,
                "stop": last,
                "checksums": {
                    name: layout.checksum(data[name][first - start : last - start]) for name in names
                },
            }
        )
    return shards
