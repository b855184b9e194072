"""Deterministic stand-ins for the target runtime, for fast runner/writer/resume tests (no model weights).

`FakeBackend` outputs depend on the token, its position AND the batch it was computed in (batch size and
longest sample), like a real padded forward can: a resumed run that re-formed different batches would be caught.
"""

from __future__ import annotations

import numpy as np
import torch

from peagle_pipeline.backends.base import SampleOutputs
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.writer import SampleData, SampleRecord
from peagle_pipeline.target_info import TargetInfo


class FakeBackend:
    """Implements backends.base.TargetBackend with closed-form outputs."""

    def __init__(
        self,
        info: TargetInfo,
        layer_ids: list[int],
        topk: int,
        last_hidden: bool = False,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.info = info
        self.layer_ids = layer_ids
        self.topk = topk
        self.last_hidden = last_hidden
        self.dtype = dtype
        self.calls: list[list[int]] = []  # lengths of every batch seen

    def forward(self, batch: list[list[int]]) -> list[SampleOutputs]:
        self.calls.append([len(s) for s in batch])
        H, V = self.info.hidden_size, self.info.vocab_size
        salt = len(batch) * 1000 + max(len(s) for s in batch)
        outs = []
        for ids in batch:
            x = torch.tensor(ids, dtype=torch.float32)
            pos = torch.arange(len(ids), dtype=torch.float32)
            base = torch.sin(
                x[:, None, None] * 0.37
                + pos[:, None, None] * 0.011
                + torch.arange(len(self.layer_ids))[None, :, None] * 1.3
                + torch.arange(H)[None, None, :] * 0.05
                + salt * 1e-3
            )
            aux = (base * 3).to(self.dtype)  # [T, n_aux, H]
            logits = torch.cos(x[:, None] * 0.11 + torch.arange(V)[None, :] * 0.7 + salt * 1e-3) * 4
            lp = torch.log_softmax(logits, dim=-1)
            top = lp.topk(self.topk, dim=-1)
            last = (base[:, 0] * 2).to(self.dtype) if self.last_hidden else None
            outs.append(
                SampleOutputs(
                    aux_hidden=aux, topk_ids=top.indices, topk_logprobs=top.values, last_hidden=last
                )
            )
        return outs

    def close(self) -> None:
        pass


def fake_meta(**over) -> CacheMeta:
    """A small CacheMeta (H=8, 3 aux layers, V=64, k=4) for writer/reader tests."""
    base = dict(
        target_name_or_path="/fake",
        target_architectures=["LlamaForCausalLM"],
        target_config_sha256="c",
        tokenizer_sha256="t",
        chat_template_sha256="ct",
        num_hidden_layers=6,
        hidden_size=8,
        vocab_size=64,
        aux_layer_ids=[2, 3, 5],
        topk=4,
        hidden_dtype="bfloat16",
        has_last_hidden=False,
        max_length=128,
        overlong="truncate",
        assistant_turns="all",
        leading_assistant="context",
        dataset_fingerprint="d",
        max_samples=None,
        world_size=1,
        shard_tokens=64,
        chunk_tokens=16,
        compress="zstd",
        length_window=256,
    )
    base.update(over)
    base.setdefault("compute_dtype", base["hidden_dtype"])
    return CacheMeta(**base)


def fake_sample(
    meta: CacheMeta, sample_id: int, length: int, seed: int | None = None
) -> tuple[SampleRecord, SampleData]:
    """Random but reproducible arrays of one sample in stored dtypes."""
    rng = np.random.default_rng(sample_id if seed is None else seed)
    H, n_aux, k = meta.hidden_size, len(meta.aux_layer_ids), meta.topk
    hidden = torch.from_numpy(rng.standard_normal((length, n_aux, H)).astype(np.float32)).to(torch.bfloat16)
    aux = hidden.view(torch.uint16).numpy() if meta.hidden_dtype == "bfloat16" else hidden.float().numpy()
    last = None
    if meta.has_last_hidden:
        h = torch.from_numpy(rng.standard_normal((length, H)).astype(np.float32)).to(torch.bfloat16)
        last = h.view(torch.uint16).numpy() if meta.hidden_dtype == "bfloat16" else h.float().numpy()
    data = SampleData(
        input_ids=rng.integers(0, meta.vocab_size, length).astype(np.int32),
        loss_mask=rng.random(length) < 0.5,
        aux_hidden=aux,
        topk_ids=rng.integers(0, meta.vocab_size, (length, k)).astype(np.int32),
        topk_logprobs=(-rng.random((length, k)) * 5).astype(np.float16),
        last_hidden=last,
    )
    return SampleRecord(sample_id, "fake.jsonl", sample_id, False), data
