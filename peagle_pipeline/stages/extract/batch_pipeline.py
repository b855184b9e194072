"""The batch pipeline: the target's outputs of a batch copied device -> host and written one batch behind the
backend, so the device computes batch i+1 while the host converts and writes batch i.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from peagle_pipeline.backends.base import SampleOutputs, TargetBackend, submit
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.writer import CacheWriter, SampleData
from peagle_pipeline.stages.extract.batch_plan import PlannedSample, RowReject

__all__ = ["BatchPipeline", "to_sample_data"]


class BatchPipeline:
    """Writes batches one behind the backend: batch i+1 is submitted (on CUDA, queued on the device) before batch
    i's outputs are waited for, converted and added to the writer, so the device never idles while the host writes.

    The writer sees exactly the calls, in exactly the order, of a plain forward-then-write loop: a reject seen
    while a batch is in flight is recorded after that batch's samples, as it would have been.

    Args:
        writer: the store's writer (its `meta` gives the stored dtypes).
        progress: called with the number of rows done (samples written, rejects recorded).
    """

    def __init__(self, writer: CacheWriter, progress: Callable[[int], Any]) -> None:
        self.writer, self.meta, self.progress = writer, writer.meta, progress
        self.new_tokens = 0
        self._pending: tuple[list[PlannedSample], Callable[[], list[SampleOutputs]]] | None = None
        self._held: list[RowReject] = []

    def submit(self, backend: TargetBackend, batch: list[PlannedSample]) -> None:
        """Start `batch` on the backend, then write the batch before it."""
        collect = submit(backend, [s.input_ids for s in batch])
        self.drain()
        self._pending = (batch, collect)

    def reject(self, item: RowReject) -> None:
        """Record a rejected row (after the batch in flight, if any)."""
        if self._pending is not None:
            self._held.append(item)
            return
        self.writer.add_reject(item.sample_id, item.source, item.source_row, item.reason)
        self.progress(1)

    def drain(self) -> None:
        """Wait for the batch in flight, write it, then the rejects held behind it."""
        if self._pending is not None:
            batch, collect = self._pending
            self._pending = None
            for sample, out in zip(batch, collect(), strict=True):
                self.writer.add(sample.ordinal, sample.record, to_sample_data(sample, out, self.meta))
            self.new_tokens += sum(len(s.input_ids) for s in batch)
            self.progress(len(batch))
        held, self._held = self._held, []
        for item in held:
            self.reject(item)


def to_sample_data(sample: PlannedSample, out: SampleOutputs, meta: CacheMeta) -> SampleData:
    """Backend outputs [T, ...] -> stored dtypes (bf16 bits as uint16, int32 ids, float16 log-probs)."""
    T = len(sample.input_ids)
    if out.aux_hidden.shape[0] != T or out.topk_ids.shape != (T, meta.topk):
        raise RuntimeError(
            f"backend returned shapes {tuple(out.aux_hidden.shape)}/{tuple(out.topk_ids.shape)} "
            f"for a sample of {T} tokens"
        )
    return SampleData(
        input_ids=np.asarray(sample.input_ids, dtype=np.int32),
        loss_mask=np.asarray(sample.loss_mask, dtype=bool),
        aux_hidden=layout.to_storage(out.aux_hidden, meta.hidden_dtype),
        topk_ids=out.topk_ids.detach().to("cpu").to(dtype=_torch().int32).numpy(),
        topk_logprobs=out.topk_logprobs.detach().to("cpu").float().numpy().astype(np.float16),
        last_hidden=layout.to_storage(out.last_hidden, meta.hidden_dtype) if meta.has_last_hidden else None,
    )


def _torch() -> Any:
    import torch

    return torch
