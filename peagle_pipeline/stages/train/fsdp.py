"""Fully sharded data parallel (`train --fsdp`): torch's own `fully_shard` (FSDP2) over the draft, and the
checkpoint state gathered to rank 0 in the single-process form.

What is sharded: every trainable parameter (embedding, fc, decoder layers, final norm, mask_hidden), each rank
holding 1/world of its rows and of the AdamW moments. What is not: frozen parameters (the lm_head, which the loss
reads outside the forward) stay whole on every rank (`ignored_params`); the target pieces the trainer keeps
beside the model (the target's final norm of `target: exact`) are plain tensors. The embedding gradient is dense
under FSDP (a sparse gradient cannot be reduce-scattered); `RowSparseAdamW` still updates only the rows of the
local shard that have a gradient, so the update equals the single-process one.

Checkpoints keep the single-process layout: `gather_model_state` gives rank 0 the full fp32 state dict (export key
names, the same as an unsharded model's) and `gather_optimizer_state` the `optimizer.state_dict()` form (states
keyed by parameter index), so a checkpoint written with or without FSDP resumes either way and exports unchanged.
Every function here is a collective: all ranks call it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "shard",
    "local",
    "gather_model_state",
    "gather_optimizer_state",
    "load_state",
    "optimizer_bytes",
]


def shard(model: torch.nn.Module, device: torch.device, world: int) -> torch.nn.Module:
    """Shard `model`'s trainable parameters over the `world` ranks of the default process group (in place; the
    mesh names `device`'s type, so `--device cpu` on a machine with CUDA stays on gloo); returns it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    frozen = {p for p in model.parameters() if not p.requires_grad}
    fully_shard(model, mesh=init_device_mesh(device.type, (world,)), ignored_params=frozen or None)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor, sharing its storage; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def gather_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0 (CPU tensors, `model.state_dict()` keys); {} on the other ranks."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full: Any = get_model_state_dict(model, options=_options())  # tensors (DSD's type is wider)
    return full


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter names in the optimizer's order (the indices of `optimizer.state_dict()`)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` of the unsharded model on rank 0 (full moments, index keys); {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full: Any = get_optimizer_state_dict(model, optimizer, options=_options())  # keyed by parameter name
    if not full:
        return {}
    index = {n: i for i, n in enumerate(_names(model, optimizer))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]
    return {"state": {index[n]: s for n, s in full["state"].items()}, "param_groups": groups}


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
) -> None:
    """Load full single-process state dicts (every rank passes them whole) into the sharded model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    opts = _options()
    set_model_state_dict(model, dict(model_state), options=opts)  # type: ignore[arg-type]  # tensors only
    names = _names(model, optimizer)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    by_name: Any = {
        "state": {names[i]: s for i, s in optimizer_state["state"].items()},
        "param_groups": groups,
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=opts)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shards of the moments; step counters included)."""
    return sum(
        local(v).numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
