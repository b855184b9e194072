"""Drafting methods: what differs between training a P-EAGLE and an EAGLE-3 draft, behind one small interface.

A method names its draft class, says whether its rows are laid out with every chain to full depth, runs the
draft over one segment of a prepared row (`hidden`), weighs each element's loss (`loss_weight`) and runs the
zero-gradient pass FSDP needs on a rank without work (`idle_hidden`). Everything else is shared by the trainer:
the cache reader and loader, the layout and its loss-carrying elements (`prepared_row`), the draft's layers and
initialisation (`core.model`), the chunked KL (`core.loss`), the optimizer, checkpoints, metrics and held-out
figures. `method_for(name)` gives the method of a `train.method` setting.

- peagle (`PEagleMethod`): COD-sampled chains, all depths in one forward with the P-EAGLE mask (`core.model`).
- eagle3 (`Eagle3Method`): every chain to full depth, K sequential steps of training-time test (`core.eagle3`);
  step d's loss weighted by `step_loss_decay ** d`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from peagle_pipeline.config import TrainConfig
from peagle_pipeline.core import cod, partition
from peagle_pipeline.core.eagle3 import Eagle3Draft, ttt_inputs
from peagle_pipeline.core.model import Owned, PEagleDraft
from peagle_pipeline.errors import BadConfig
from peagle_pipeline.stages.train.prepared_row import Prepared

__all__ = ["DraftMethod", "PEagleMethod", "Eagle3Method", "METHODS", "method_for"]

MaskFn = Callable[..., Any]  # (layout, query=None) -> the attention mask for the trainer's device


class DraftMethod(ABC):
    """One drafting method's part of a training step."""

    name: ClassVar[str]
    model_class: ClassVar[type[PEagleDraft]]
    full_chains: ClassVar[bool]
    """Whether training rows hold every chain to full depth (no COD sampling)."""
    uses_mask_token: ClassVar[bool]
    """Whether depth >= 1 slots read a mask token (chosen at the start of a run and exported)."""

    @abstractmethod
    def hidden(
        self, module: torch.nn.Module, p: Prepared, seg: partition.Segment, mask: MaskFn, num_layers: int
    ) -> torch.Tensor:
        """[m, H] final-normed hidden states of the segment's owned elements (`seg.owned_elements` order), from
        `module` (the draft, or its DDP wrapper: called, so the wrapper's hooks run)."""

    def loss_weight(self, cfg: TrainConfig, depth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Each element's loss weight (`core.loss.kl_topk`'s `weight`): the loss-carrying elements, alike."""
        return valid

    @abstractmethod
    def idle_hidden(
        self, module: torch.nn.Module, aux_size: int, device: torch.device, mask: MaskFn
    ) -> torch.Tensor:
        """Hidden states of a one-element forward (every parameter takes part; the caller zeroes its loss)."""


class PEagleMethod(DraftMethod):
    """P-EAGLE: COD-sampled chains, every depth drafted in one pass (mask token and `mask_hidden` at depth >= 1)."""

    name = "peagle"
    model_class = PEagleDraft
    full_chains = False
    uses_mask_token = True

    def hidden(
        self, module: torch.nn.Module, p: Prepared, seg: partition.Segment, mask: MaskFn, num_layers: int
    ) -> torch.Tensor:
        sub = p.layout.select(seg.index)
        q = None if bool(seg.owned.all()) else seg.out_index  # all owned: plain forward, no query subset
        real = sub.depth == 0
        # 0, 1, 2, ... at the depth-0 elements, 0 elsewhere (a cumulative sum: no count read back from the device)
        aux_index = torch.where(real, real.long().cumsum(0) - 1, 0)
        aux = p.batch.aux_hidden[sub.target[real]]  # in the cache's dtype: the draft casts the rows it uses
        # a 1-layer draft with a query subset runs no full-square attention: no [n, n] mask (dense on the CPU, 73 MiB
        # in the last of 4 segments of a row of 2 x 4096-token samples)
        full = None if q is not None and num_layers == 1 else mask(sub)
        return module(
            p.batch.input_ids[sub.target],
            aux,
            ~real,
            sub.position,
            full,
            aux_index=aux_index,
            owned=None if q is None else Owned(q, mask(sub, q)),
        )

    def idle_hidden(
        self, module: torch.nn.Module, aux_size: int, device: torch.device, mask: MaskFn
    ) -> torch.Tensor:
        one = torch.zeros(1, dtype=torch.long, device=device)
        lay = cod.CODLayout(anchor=one, depth=one, doc=one, position=one, target=one)
        return module(one, torch.zeros(1, aux_size, device=device), one.bool(), one, mask(lay))


class Eagle3Method(DraftMethod):
    """EAGLE-3: every chain to full depth, K sequential steps (each reads the previous step's token and state)."""

    name = "eagle3"
    model_class = Eagle3Draft
    full_chains = True
    uses_mask_token = False

    def hidden(
        self, module: torch.nn.Module, p: Prepared, seg: partition.Segment, mask: MaskFn, num_layers: int
    ) -> torch.Tensor:
        # the whole row (its one segment: `TrainConfig` refuses sequence partitions): elements that carry no
        # loss still feed the later steps of their chains
        hidden = module(**ttt_inputs(p.layout, p.batch.input_ids, p.batch.aux_hidden))
        return hidden[seg.owned_elements]

    def loss_weight(self, cfg: TrainConfig, depth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if cfg.step_loss_decay == 1.0:
            return valid
        return valid.float() * torch.pow(cfg.step_loss_decay, depth.double()).float()

    def idle_hidden(
        self, module: torch.nn.Module, aux_size: int, device: torch.device, mask: MaskFn
    ) -> torch.Tensor:
        one = torch.zeros(1, dtype=torch.long, device=device)
        lay = cod.CODLayout(anchor=one, depth=one, doc=one, position=one, target=one)
        return module(one, torch.zeros(1, aux_size, device=device), one, [mask(lay)], [])


METHODS: dict[str, DraftMethod] = {m.name: m for m in (PEagleMethod(), Eagle3Method())}


def method_for(name: str) -> DraftMethod:
    """The method of a `train.method` setting.

    Raises:
        BadConfig: an unknown name.
    """
    if name not in METHODS:
        raise BadConfig(f"unknown method {name!r}: choose one of {', '.join(METHODS)}")
    return METHODS[name]
