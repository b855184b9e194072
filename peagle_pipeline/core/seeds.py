"""Seeds of independent random streams, mixed from a run's seed and what the stream is for (shuffle, held-out split,
COD rows, draft init)."""

from __future__ import annotations

import hashlib

__all__ = ["mix_seed"]


def mix_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of parts (independent streams for shuffle, split, COD rows, init)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
