"""The commit of a cache store, after its shards are written and fsynced: the tables, then the manifest, LAST.

Steps 2 and 3 of the commit protocol (`writer.py`): the store's tables (`samples.parquet`, `rejects.parquet`,
`token_counts.npy`, `all_token_counts.npy`) are replaced atomically, then `manifest.json`, which names the
committed tokens and samples, the checksum of every array's rows in every shard and of every table. A reader sees
only what a manifest names; a table newer than its manifest (a kill between the two) is ignored on resume.

Worked example (a commit that wrote shards 2 and 3 of a store with arrays `input_ids` [T] and `aux_hidden`
[T, n_aux, H]): `commit_files` lists, in upload order, `zarr.json`, `input_ids/zarr.json`, `input_ids/c/2`,
`input_ids/c/3`, `aux_hidden/zarr.json`, `aux_hidden/c/2/0/0`, `aux_hidden/c/3/0/0`, the four tables, and
`manifest.json` last.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.store_arrays import ArraySpecs, shard_key
from peagle_pipeline.errors import CorruptCache
from peagle_pipeline.runtime import atomic_write_bytes, atomic_write_json, fsync_dir

__all__ = [
    "read_manifest",
    "SAMPLE_TYPES",
    "REJECT_TYPES",
    "table_blobs",
    "write_tables",
    "write_manifest",
    "commit_files",
]

_MANIFEST_KEYS = (
    "format_version",
    "meta",
    "committed_tokens",
    "committed_samples",
    "complete",
    "shards",
    "tables",
)


def read_manifest(store_dir: Path) -> dict[str, Any] | None:
    """The store's manifest, or None if it has none yet (nothing committed).

    Raises:
        CorruptCache: the manifest is not a JSON object with the manifest's keys (it is replaced atomically,
            so this is damage, e.g. a truncated copy).
    """
    path = store_dir / layout.MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or any(k not in manifest for k in _MANIFEST_KEYS):
        raise CorruptCache(
            f"{path} is damaged (not a complete manifest): delete {store_dir} to redo this rank "
            "(or restore the file from a good copy)"
        )
    return manifest


def _table_bytes(rows: list[dict[str, Any]], columns: tuple[str, ...], types: dict[str, str]) -> bytes:
    import pandas as pd

    frame = pd.DataFrame(rows, columns=list(columns))
    frame = frame.astype(types)
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False, engine="pyarrow")
    return buf.getvalue()


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


SAMPLE_TYPES = {
    "sample_id": "int64",
    "source": "string",
    "source_row": "int64",
    "store": "string",
    "offset": "int64",
    "length": "int64",
    "num_supervised": "int64",
    "truncated": "bool",
}
REJECT_TYPES = {
    "sample_id": "int64",
    "source": "string",
    "source_row": "int64",
    "store": "string",
    "reason": "string",
}


def table_blobs(
    samples: list[dict[str, Any]],
    rejects: list[dict[str, Any]],
    counts: np.ndarray,
    all_counts: np.ndarray,
) -> dict[str, bytes]:
    """The bytes of every table of a commit, by file name: the committed sample rows (storage order), the
    rejected rows (by sample id), the supervised token counts int64 [V] and the counts of every token int64 [V]."""
    return {
        layout.SAMPLES_TABLE: _table_bytes(samples, layout.SAMPLE_COLUMNS, SAMPLE_TYPES),
        layout.REJECTS_TABLE: _table_bytes(rejects, layout.REJECT_COLUMNS, REJECT_TYPES),
        layout.TOKEN_COUNTS: _npy_bytes(counts),
        layout.ALL_TOKEN_COUNTS: _npy_bytes(all_counts),
    }


def write_tables(store_dir: Path, tables: dict[str, bytes]) -> None:
    """Step 2: replace each table atomically (old or new, never half)."""
    for name, blob in tables.items():
        atomic_write_bytes(store_dir / name, blob)


def write_manifest(store_dir: Path, manifest: dict[str, Any]) -> None:
    """Step 3, the commit itself: replace the manifest atomically and fsync the store directory."""
    atomic_write_json(store_dir / layout.MANIFEST, manifest)
    fsync_dir(store_dir)


def commit_files(specs: ArraySpecs, new_shards: list[int], tables: dict[str, bytes]) -> list[str]:
    """The store's files a commit changed (relative paths, the manifest last): Zarr metadata, new shards,
    tables, manifest."""
    files = ["zarr.json"]
    for name, (_, inner) in specs.items():
        files.append(f"{name}/zarr.json")
        files += [shard_key(name, i, inner) for i in new_shards]
    return [*files, *tables, layout.MANIFEST]
