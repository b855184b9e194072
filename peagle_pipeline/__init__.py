"""peagle-pipeline: offline extraction and training of P-EAGLE draft models for vLLM.

Importing the package is cheap: heavy modules (torch, zarr) load only when `open_cache` or `verify_cache`
is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["__version__", "open_cache", "verify_cache"]

if TYPE_CHECKING:
    from peagle_pipeline.cache.reader import Cache


def open_cache(path: str, **kwargs: Any) -> Cache:
    """Open an extraction cache read-only (see `peagle_pipeline.cache.reader.open_cache`)."""
    from peagle_pipeline.cache.reader import open_cache as _open

    return _open(path, **kwargs)


def verify_cache(cache: Cache) -> list[str]:
    """Read an opened cache back; one line per problem (see `peagle_pipeline.cache.verify.verify_cache`)."""
    from peagle_pipeline.cache.verify import verify_cache as _verify

    return _verify(cache)
