"""A cache location: create it, check it against the settings of this run, claim it, or remove what a failed
first run left. Writes cache.json (first writer, exclusive), extract.yaml and target/ (via `cache.target`).

The one place that decides whether a directory may hold this cache; the stores inside are `cache/writer.py`'s.
Never reads settings objects (the stage passes the resolved settings as YAML text) and never runs models.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.target import TargetSource, save_target_pieces
from peagle_pipeline.errors import IncompatibleCache, OutOfSpace, ResumeMismatch, from_os_error
from peagle_pipeline.runtime import atomic_write_text, claim_output_dir, create_exclusive, fsync_dir

__all__ = [
    "prepare_cache",
    "check_meta",
    "read_recorded_meta",
    "compute_dtype_in",
    "length_window_in",
    "recorded_compute_dtype",
    "recorded_length_window",
    "remove_new_cache",
]


def prepare_cache(
    root: str | os.PathLike[str], meta: CacheMeta, settings_yaml: str, target: TargetSource
) -> Path:
    """Create or check the cache directory: cache.json (first writer, exclusive), extract.yaml, target/.

    Args:
        root: the cache directory (created when absent).
        meta: this run's metadata; an existing cache.json must equal it (`CacheMeta.differences`).
        settings_yaml: the resolved extract settings, written as extract.yaml by the first writer.
        target: where target/ comes from (read only when target/ does not exist yet).

    Raises:
        OutputExists: the directory holds something that is not a cache.
        IncompatibleCache: a cache of another format version.
        ResumeMismatch: a cache made with other settings (the message names them).
    """
    root = Path(root)
    existed = root.exists()
    claim_output_dir(root, layout.CACHE_META, "a peagle cache")
    meta_path = root / layout.CACHE_META
    created = not meta_path.exists()
    if created:
        create_exclusive(meta_path, json.dumps(meta.to_dict(), indent=2, sort_keys=True) + "\n")
    check_meta(meta_path, meta)
    try:
        yaml_path = root / layout.EXTRACT_YAML
        if not yaml_path.exists():
            atomic_write_text(yaml_path, settings_yaml)
        _save_target(root, target)
    except BaseException:  # e.g. a truncated model.safetensors: a cache this call stamped is removed again
        if created:
            remove_new_cache(root, existed)
        raise
    return root


def _save_target(root: Path, target: TargetSource) -> None:
    """Write root/target/ (when absent) through a temporary folder that no way out leaves behind."""
    target_dir = root / layout.TARGET_DIR
    if target_dir.exists():
        return
    tmp = root / f".peagle-target-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_target_pieces(tmp, target)
        os.rename(tmp, target_dir)  # atomic; fails if another rank got there first
        fsync_dir(root)
    except (OSError, OutOfSpace) as err:
        if target_dir.exists():
            return
        if isinstance(err, OutOfSpace) or isinstance(from_os_error(err), OutOfSpace):
            # name the cache's folder, not the model file being copied (shutil's error names the source)
            raise OutOfSpace(
                f"no space left while writing {target_dir} (the target's files): free some space and re-run "
                "the same command"
            ) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_meta(meta_path: Path, meta: CacheMeta) -> None:
    """Refuse a cache.json of another format or with other settings than `meta`.

    Raises:
        IncompatibleCache: damaged file or another format version.
        ResumeMismatch: other settings (the message names each and both values).
    """
    try:
        found = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise IncompatibleCache(f"{meta_path} is damaged; use a new output directory") from None
    if found.get("format_version") != layout.FORMAT_VERSION:
        raise IncompatibleCache(
            f"{meta_path.parent} is a cache of format {found.get('format_version')}; this "
            f"version writes {layout.FORMAT_VERSION}: use a new output directory"
        )
    old = CacheMeta.from_dict(found)
    diffs = old.differences(meta)
    if diffs:
        raise ResumeMismatch(
            f"{meta_path.parent} was extracted with other settings ({_explain(old, meta, diffs)}); "
            "use the original settings to resume, or a new output directory"
        )


def _explain(old: CacheMeta, new: CacheMeta, names: list[str]) -> str:
    a, b = old.to_dict(), new.to_dict()
    return "; ".join(f"{n}: {a[n]!r} in the cache, {b[n]!r} now" for n in names)


def read_recorded_meta(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """root/cache.json as a dict, None when absent, damaged or not an object (`prepare_cache` then says why)."""
    try:
        found: Any = json.loads((Path(root) / layout.CACHE_META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def recorded_compute_dtype(root: str | os.PathLike[str]) -> str | None:
    """The logical compute dtype ("bfloat16"/"float32") in root/cache.json (see `compute_dtype_in`)."""
    return compute_dtype_in(read_recorded_meta(root))


def recorded_length_window(root: str | os.PathLike[str]) -> int | None:
    """The storage order's length window in root/cache.json (see `length_window_in`)."""
    return length_window_in(read_recorded_meta(root))


def compute_dtype_in(found: dict[str, Any] | None) -> str | None:
    """The logical compute dtype ("bfloat16"/"float32") of a read cache.json (old caches: their hidden dtype);
    None for no readable cache.json (`prepare_cache` then says what is wrong). Pure."""
    logical = None if found is None else found.get("compute_dtype") or found.get("hidden_dtype")
    return logical if isinstance(logical, str) else None


def length_window_in(found: dict[str, Any] | None) -> int | None:
    """The storage order's length window of a read cache.json: 1 for a cache written before the field existed
    (row order); None for no readable cache.json (`prepare_cache` then says what is wrong). Pure."""
    window = None if found is None else found.get("length_window", 1)
    return window if isinstance(window, int) and window > 0 else None


def remove_new_cache(root: Path, existed: bool) -> None:
    """Remove the cache files a first run created in `root` (it held nothing else), and `root` if it is new."""
    for name in (layout.CACHE_META, layout.EXTRACT_YAML):
        (root / name).unlink(missing_ok=True)
    for name in (layout.TARGET_DIR, layout.STORES_DIR):
        shutil.rmtree(root / name, ignore_errors=True)
    if not existed:
        with contextlib.suppress(OSError):
            root.rmdir()
