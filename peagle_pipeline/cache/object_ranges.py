"""Byte ranges of objects on an object store, fetched together: how a remote cache's samples are read.

One sample needs a few ranges per array (each shard's index once, then the bytes of the chunks it covers).
They go out in one fsspec `cat_ranges` call, which async stores such as s3fs run concurrently; a long range is
cut into parts of `PART_BYTES` (one connection's throughput is limited; parallel ranged GETs are how object
stores are read fast). Retries of transient failures are the driver's own (s3fs and botocore: `AWS_MAX_ATTEMPTS`).

What fails is told apart, because the user's next step differs:
- a missing object: the cache lost a file (CorruptCache: re-extract, or skip such samples);
- anything else from the store (the network, the endpoint, credentials): the cache is not at fault
  (StoreUnreachable: run again once the store answers; training resumes from its last checkpoint).
"""

from __future__ import annotations

from typing import Any

from peagle_pipeline.cache.remote import describe_error
from peagle_pipeline.errors import CorruptCache, StoreUnreachable

__all__ = ["PART_BYTES", "fetch_ranges", "unreachable"]

PART_BYTES = 512 * 1024


def fetch_ranges(fs: Any, ranges: list[tuple[str, int, int | None]], url: str) -> list[bytes]:
    """The bytes of each (path, start, end) range of `fs`, fetched in one concurrent batch; a negative start with
    end None is a suffix (the last -start bytes).

    Raises:
        CorruptCache: an object is missing.
        StoreUnreachable: any other failure of the store (`url` names it in the message).
    """
    if not ranges:
        return []
    parts = []  # (range number, path, start, end)
    for n, (path, begin, end) in enumerate(ranges):
        cuts = [begin] if end is None else list(range(begin, end, PART_BYTES))
        for i, a in enumerate(cuts):
            b = end if end is None or i + 1 == len(cuts) else cuts[i + 1]
            parts.append((n, path, a, b))
    try:
        got = fs.cat_ranges(
            [p[1] for p in parts], [p[2] for p in parts], [p[3] for p in parts], on_error="raise"
        )
    except FileNotFoundError as err:
        raise CorruptCache(
            f"an object of the cache {url} is missing ({err.args[0] if err.args else err})"
        ) from None
    except Exception as err:  # s3fs/aiohttp/botocore raise many types
        raise unreachable(url, err) from None
    out: list[list[bytes]] = [[] for _ in ranges]
    for (n, _, _, _), blob in zip(parts, got, strict=True):
        out[n].append(blob)
    return [b"".join(pieces) if len(pieces) > 1 else pieces[0] for pieces in out]


def unreachable(url: str, err: BaseException) -> StoreUnreachable:
    """The error for a read of the cache at `url` that its store did not answer (`err`: the driver's exception)."""
    return StoreUnreachable(
        f"cannot read the cache {url} ({describe_error(err)}); the cache is not damaged: run the same command again "
        "once the store answers (train: add --resume)"
    )
