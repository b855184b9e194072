"""vLLM KV connector that saves the aux hidden states of each request to a safetensors file (CPU and GPU).

vLLM's `extract_hidden_states` speculative method stores the selected layers' residual streams in a cache-only
attention layer; `ExampleHiddenStatesConnector` copies them out per request when the request finishes. Its copy
path uses CUDA streams, CUDA events and pinned host memory, so it fails on CPU. This subclass keeps everything
else (scheduling, lock files, thread-pool writes) and, only when the cache lives on the CPU, replaces the copy
with a plain synchronous slice. This module is imported by vLLM's worker processes by its module path; it never
imports anything from peagle_pipeline (workers must be able to load it on their own).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["PeagleHiddenStatesConnector", "CONNECTOR_NAME", "CONNECTOR_MODULE"]

CONNECTOR_NAME = "PeagleHiddenStatesConnector"
CONNECTOR_MODULE = __name__


class _Done:
    """Stands in for the CUDA event of the stock copy: a CPU copy is complete when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class PeagleHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` whose device-to-host copy also works when the KV cache is on the CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)  # GPU: the stock async DtoH copy into pinned memory
            return
        if not self._is_tp_rank_zero:
            return
        block = self._block_size
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(block, dtype=torch.long)[None, :] + block_ids[:, None] * block).flatten()
        num_tokens = pending.token_ids.shape[0]
        # .clone(): the request's blocks are freed (and reused) once we report it done below.
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()  # [T, n_aux, H]
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done: Any = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
