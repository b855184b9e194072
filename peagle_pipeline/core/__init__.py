"""Pure-torch P-EAGLE building blocks: COD sampling, the attention mask, the draft vocabulary, the draft model,
the chunked loss and sequence partitioning. Nothing here does I/O, reads the environment or uses global RNG."""

from __future__ import annotations

__all__ = ["cod", "mask", "vocab", "model", "loss", "partition"]
