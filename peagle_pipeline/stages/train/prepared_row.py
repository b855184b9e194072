"""A packed row laid out for the forward: its COD layout, the elements that carry loss, and its segments.

The row's COD draws use a generator of its own, seeded by (seed, epoch, row index): resuming, and spreading rows
over other ranks or micro-steps, give bit-identical layouts (`core.cod.build_layout`, `core.partition`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from peagle_pipeline.config import TrainConfig
from peagle_pipeline.core import cod, loss, partition
from peagle_pipeline.core.seeds import mix_seed
from peagle_pipeline.core.vocab import DraftVocab
from peagle_pipeline.stages.train.packed_batch import PackedBatch

__all__ = ["Prepared", "lay_out_row"]


@dataclass
class Prepared:
    """One packed row ready for forward: batch on device, its COD layout, counted elements, segments."""

    batch: PackedBatch
    layout: cod.CODLayout
    valid: torch.Tensor  # BoolTensor[N]: elements that carry loss
    segments: list[partition.Segment]


def lay_out_row(
    batch: PackedBatch,
    cfg: TrainConfig,
    cod_cfg: cod.CODConfig,
    vocab: DraftVocab | None,
    device: torch.device,
    full: bool = False,
) -> Prepared:
    """Move `batch` to `device`, sample its COD layout (`cod_cfg`; full depth when `full`) and plan its segments
    (`cfg.sequence_partitions`; one when `full`). `vocab`: the draft vocabulary (None: the target's; top-k targets
    outside it carry no loss)."""
    b = dataclasses.replace(
        batch,
        **{
            k: getattr(batch, k).to(device, non_blocking=True)  # (no-ops for rows `ahead_to_device` moved)
            for k in ("input_ids", "aux_hidden", "topk_ids", "topk_logprobs", "weight")
        },
        last_hidden=None if batch.last_hidden is None else batch.last_hidden.to(device, non_blocking=True),
    )
    g = torch.Generator().manual_seed(mix_seed("cod", cfg.seed, batch.epoch, batch.row))
    lay = cod.build_layout(b.doc_lengths, batch.weight.cpu(), cod_cfg, g, full=full).to(device)
    valid = lay.element_weight(b.weight)
    if cfg.target == "topk" and len(lay):
        _, _, has, _ = loss.topk_targets(b.topk_ids[lay.target], b.topk_logprobs[lay.target], vocab)
        valid = valid & has
    segs = partition.plan_segments(lay, 1 if full else cfg.sequence_partitions, valid) if len(lay) else []
    return Prepared(b, lay, valid, segs)
