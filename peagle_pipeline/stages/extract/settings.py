"""The extract settings settled for one run: the device the target runs on, the forward dtype, the backend's own
settings, the "auto" values taken from the cache being resumed, and the aux layer ids, gathered in one
`ExtractPlan` (`settle`) that the stage's loop, the cache metadata and the backend take.

Reads nothing but what it is given (and whether CUDA is available); the stage entry reads the recorded cache.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from peagle_pipeline.backends.base import BackendSettings
from peagle_pipeline.cache.location import compute_dtype_in, length_window_in
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.hardware import describe_compute_dtype, resolve_compute_dtype
from peagle_pipeline.stages.extract.batch_plan import DEFAULT_LENGTH_WINDOW
from peagle_pipeline.target_info import (
    DEFAULT_LAYER_RULE,
    TargetInfo,
    check_layer_ids,
    check_topk,
    default_layer_ids,
    spelled_default_layer_ids,
)

__all__ = [
    "ExtractPlan",
    "settle",
    "check_target",
    "target_device",
    "forward_dtype",
    "backend_settings",
    "Settled",
    "settle_auto",
    "fit_to_positions",
    "resolve_layers",
    "collapsed_layers_note",
]


def target_device(cfg: ExtractConfig) -> str:
    """The device the target runs on, as a string: `auto` -> "cuda" when CUDA is available, else "cpu"."""
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def forward_dtype(cfg: ExtractConfig, device: str) -> Literal["bf16", "fp32"]:
    """The dtype of the target forward: `cfg.compute_dtype`, where auto means fp32 when the stored dtype is fp32
    (a bf16 forward stored in fp32 only costs space), else the hardware's choice (`resolve_compute_dtype`)."""
    if cfg.compute_dtype == "auto" and cfg.dtype == "fp32":
        return "fp32"
    return resolve_compute_dtype(cfg.compute_dtype, device)


def backend_settings(cfg: ExtractConfig) -> BackendSettings:
    """The target backend's own settings from the extract section (the forward dtype resolved)."""
    return BackendSettings(
        model=cfg.model,
        compute_dtype=forward_dtype(cfg, target_device(cfg)),
        topk=cfg.topk,
        last_hidden=cfg.last_hidden,
        device=cfg.device,
        topk_chunk=cfg.topk_chunk,
        max_length=cfg.max_length,
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
    )


class Settled(NamedTuple):
    """The settings of one extract run with their "auto" values settled (`settle_auto`)."""

    cfg: ExtractConfig
    """As recorded (extract.yaml, cache.json): length_window settled; compute_dtype as given."""
    run_cfg: ExtractConfig
    """What the backend runs: `cfg` with compute_dtype settled too (the dtype cache.json records)."""
    why: str
    """The line that says which compute dtype and why."""


_COMPUTED: dict[str, Literal["bf16", "fp32"]] = {"bfloat16": "bf16", "float32": "fp32"}


def settle_auto(
    cfg: ExtractConfig, recorded: dict[str, Any] | None, device: str, bf16_only: str | None = None
) -> Settled:
    """Settle the "auto" values of `cfg` from the cache being resumed (`recorded`: its cache.json as read once,
    None for a new cache) and the device the target runs on. Reads nothing itself.

    Under `compute_dtype: auto` a cache that already exists keeps the forward dtype it was started with (one cache
    never mixes bf16 and fp32 forwards, whichever machine resumes it or writes another rank); otherwise
    `forward_dtype` decides from the stored dtype and the hardware. An explicit setting is used as given (and
    refused by `prepare_output` if the cache recorded another). `bf16_only`: why the backend runs this target in
    bf16 only on `device` (None when any dtype runs); auto then means bf16. An unset length_window keeps the resumed
    cache's storage order, else takes DEFAULT_LENGTH_WINDOW.
    """
    chosen = forward_dtype(cfg, device)
    kept = _COMPUTED.get(compute_dtype_in(recorded) or "") if cfg.compute_dtype == "auto" else None
    if kept is not None:
        line = describe_compute_dtype("auto", device, kept)
        compute, why = kept, line[: line.index(" (")] + " (auto: kept from the cache being resumed)"
    elif cfg.compute_dtype == "auto" and bf16_only is not None:
        compute, why = "bf16", f"compute dtype bf16 on {device} ({bf16_only})"
    elif cfg.compute_dtype == "auto" and cfg.dtype == "fp32":
        compute, why = chosen, f"compute dtype fp32 on {device} (auto: dtype is fp32)"
    else:
        compute, why = chosen, describe_compute_dtype(cfg.compute_dtype, device, chosen)
    window = cfg.length_window or length_window_in(recorded) or DEFAULT_LENGTH_WINDOW
    settled = dataclasses.replace(cfg, length_window=window)
    return Settled(settled, dataclasses.replace(settled, compute_dtype=compute), why)


def fit_to_positions(run_cfg: ExtractConfig, max_positions: int | None) -> tuple[ExtractConfig, str | None]:
    """What the vLLM backend can extract within the target's `max_positions` (max_position_embeddings): a sample
    of T tokens is scored with one token sampled after it (its last row's distribution), and vLLM refuses T + 1
    past the model's length, so samples keep at most max_positions - 1 tokens there. The HF backend and the
    recorded settings keep max_length as given. Returns the settings to run and a note when the cut moved.

    E.g. max_length 2048 on a target with 2048 positions: samples keep 2,047 tokens under vLLM.
    """
    if run_cfg.backend != "vllm" or not max_positions or run_cfg.max_length < max_positions:
        return run_cfg, None
    limit = int(max_positions) - 1
    note = (
        f"samples keep at most {limit} tokens, not max_length {run_cfg.max_length}: the target has "
        f"{max_positions} positions and vLLM scores each sample with one token sampled after it"
    )
    return dataclasses.replace(run_cfg, max_length=limit), note


def resolve_layers(cfg: ExtractConfig, num_hidden_layers: int) -> list[int]:
    """Aux layer ids, ascending; BadInput when outside 0..L."""
    return check_layer_ids(cfg.layers or default_layer_ids(num_hidden_layers), num_hidden_layers)


def collapsed_layers_note(cfg: ExtractConfig, num_hidden_layers: int) -> str | None:
    """On small targets the default ids [2, L//2, L-3] coincide (L=6: [2, 3, 3]); the draft then gets fewer aux
    hidden states than the usual 3. Not an error (tiny test models rely on it), but the user should know."""
    L = num_hidden_layers
    spelled = spelled_default_layer_ids(L)
    ids = default_layer_ids(L)
    if cfg.layers or len(ids) == len(spelled):
        return None
    return (
        f"the default aux layers {DEFAULT_LAYER_RULE} of this {L}-layer target are {spelled}: the draft gets "
        f"{len(ids)} aux hidden states instead of 3; pass --layers to choose 3 distinct ids"
    )


def check_target(cfg: ExtractConfig, info: TargetInfo) -> list[int]:
    """The aux layer ids of `cfg` for target `info`, once they and the top-k are checked against it.

    Raises:
        BadInput: a layer id outside 0..L, or a top-k above the vocabulary.
    """
    layer_ids = resolve_layers(cfg, info.num_hidden_layers)
    check_topk(cfg.topk, info.vocab_size)
    return layer_ids


@dataclass(frozen=True)
class ExtractPlan:
    """Everything one extract run settled before the target loads: what is recorded, what the backend runs, the
    aux layers, this writer's rank, and what the start says. A pure function of the config, the target's facts,
    the cache being resumed and the device (`settle`)."""

    cfg: ExtractConfig
    """As recorded in extract.yaml and cache.json: `length_window` settled, `compute_dtype` and `max_length` as
    given."""
    info: TargetInfo
    layer_ids: tuple[int, ...]
    rank: int
    world: int
    backend: BackendSettings
    """What the backend runs: the forward dtype settled, `max_length` fit to the target's positions."""
    why: str
    """The line that says which forward dtype and why."""
    notes: tuple[str, ...]
    """What the summary notes of the settings (collapsed default layers, a shortened max_length)."""


def settle(
    cfg: ExtractConfig,
    info: TargetInfo,
    recorded: dict[str, Any] | None,
    device: str,
    rank_world: tuple[int, int],
    bf16_only: str | None = None,
) -> ExtractPlan:
    """The plan of one extract run (`ExtractPlan`): the layers checked (`check_target`), the "auto" values settled
    from `recorded` (the resumed cache's cache.json, None for a new cache) and the `device` (`settle_auto`, with
    `bf16_only` as there), and max_length fit to the target's positions (`fit_to_positions`).

    E.g. a new bf16 cache of a 30-layer target under `compute_dtype: auto` on a CPU with bf16 units: layer_ids
    (2, 15, 27), backend.compute_dtype "bf16", cfg.compute_dtype still "auto".
    """
    from peagle_pipeline.model_dir import text_config

    layer_ids = check_target(cfg, info)
    settled = settle_auto(cfg, recorded, device, bf16_only)
    run_cfg, length_note = fit_to_positions(
        settled.run_cfg, text_config(info.config).get("max_position_embeddings")
    )
    notes = tuple(n for n in (collapsed_layers_note(cfg, info.num_hidden_layers), length_note) if n)
    rank, world = rank_world
    return ExtractPlan(
        settled.cfg, info, tuple(layer_ids), rank, world, backend_settings(run_cfg), settled.why, notes
    )
