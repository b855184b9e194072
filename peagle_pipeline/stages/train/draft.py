"""The draft model of a training run, built from the cache alone (target config, pieces, token counts, tokenizer)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from peagle_pipeline.config import TrainConfig
from peagle_pipeline.core import vocab
from peagle_pipeline.core.draft_config import DraftConfig, has_qk_norm
from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.core.seeds import mix_seed
from peagle_pipeline.core.target_convention import (
    exact_target_refusal,
    has_gated_attention,
    has_rope,
    mlp_activation,
)
from peagle_pipeline.core.target_init import init_from_target_layer
from peagle_pipeline.errors import BadConfig
from peagle_pipeline.stages.draft_spec import DRAFT_SPEC, DraftSpec
from peagle_pipeline.stages.train.methods import method_for

__all__ = [
    "build_draft",
    "start_from_target",
    "choose_mask_token",
    "vocab_coverage",
    "describe_vocab_coverage",
    "describe_mask_token",
    "require_last_hidden",
]

log = logging.getLogger(__name__)


def build_draft(cache: Any, cfg: TrainConfig) -> tuple[PEagleDraft, DraftSpec, vocab.DraftVocab | None]:
    """The draft from the cache only: target config + pieces, token counts -> vocabulary, tokenizer -> mask id
    (P-EAGLE only); its class is the method's (`stages.train.methods`).

    Raises:
        BadConfig: draft_vocab_size explicitly larger than the target vocabulary; exact target without last
            hidden states in the cache, or for a target whose log-probs it cannot compute
            (`core.target_convention.exact_target_refusal`: a soft-cap, a final LayerNorm).
    """
    meta = cache.meta
    size = _draft_vocab_size(cfg.draft_vocab_size, int(meta.vocab_size))
    require_last_hidden(cfg.target, meta, f"cache {cfg.cache}")
    dvocab = vocab.build_draft_vocab(torch.from_numpy(cache.token_counts()), size)
    pieces = cache.target_pieces()
    method = method_for(cfg.method)
    mask_id = _mask_token_id(cache, pieces, cfg) if method.uses_mask_token else 0  # 0: unused, not exported
    target_config = cache.target_config()
    refusal = exact_target_refusal(target_config) if cfg.target == "exact" else None
    if refusal:
        raise BadConfig(
            f"target=exact computes the target's log-probs as lm_head(rms_norm(last hidden state)), and this "
            f"target {refusal}: use target=topk"
        )
    qk_norm = draft_qk_norm(cfg, target_config)
    dcfg = DraftConfig.from_target_config(
        target_config,
        num_layers=cfg.draft_layers,
        num_aux=len(meta.aux_layer_ids),
        draft_vocab_size=size,
        mask_token_id=mask_id,
        norm_before_residual=cfg.norm_before_residual,
        qk_norm=qk_norm,
    )
    keep = None if dvocab.is_identity else dvocab
    g = torch.Generator().manual_seed(mix_seed("init", cfg.seed))
    model = method.model_class(dcfg, pieces, keep, generator=g, grad_checkpointing=cfg.grad_checkpointing)
    if cfg.init_from_target:
        start_from_target(model, cache)
    spec = DraftSpec(
        target_config=target_config,
        verifier_name_or_path=meta.target_name_or_path,
        verifier_architectures=list(meta.target_architectures),
        aux_layer_ids=list(meta.aux_layer_ids),
        draft_layers=cfg.draft_layers,
        draft_vocab_size=size,
        mask_token_id=mask_id,
        norm_before_residual=cfg.norm_before_residual,
        depths=cfg.depths,
        qk_norm=qk_norm,
        method=cfg.method,
        target_identity={
            "target_config_sha256": meta.target_config_sha256,
            "tokenizer_sha256": meta.tokenizer_sha256,
            "chat_template_sha256": meta.chat_template_sha256,
        },
    )
    return model, spec, keep


def _mask_token_id(cache: Any, pieces: dict[str, torch.Tensor], cfg: TrainConfig) -> int:
    """The mask token of a P-EAGLE draft (`choose_mask_token`; EAGLE-3 feeds drafted tokens only, and has none)."""
    return choose_mask_token(cache, int(pieces["embed_tokens.weight"].shape[0]), cfg.mask_token_id).token_id


def _draft_vocab_size(size: int, V: int) -> int:
    """The draft vocabulary's size: `size`, or the target's V when the default is larger (warned).

    Raises:
        BadConfig: a `size` other than the default larger than V.
    """
    if size <= V:
        return size
    default = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "draft_vocab_size")
    if size != default:
        raise BadConfig(
            f"draft_vocab_size {size} is larger than the target vocabulary ({V}): use at most {V}"
        )
    log.warning("draft_vocab_size %d exceeds the target vocabulary; using %d", size, V)
    return V


def draft_qk_norm(cfg: TrainConfig, target_config: dict[str, Any]) -> bool:
    """Whether the draft's layers are Qwen3 ones (QK-norm): `draft_arch` qwen3 or llama, or for auto the target's
    family. A resumed run keeps the layers its checkpoints hold (its draft.json's `qk_norm`; train.yaml has already
    refused a changed `draft_arch`): a run from before drafts had Qwen3 layers has Llama ones. Said on the terminal
    whenever the style is not simply the target's Llama one."""
    target_qk = has_qk_norm(target_config)
    spec = Path(cfg.output) / DRAFT_SPEC
    if cfg.resume and spec.is_file():
        qk_norm = DraftSpec.load(cfg.output).qk_norm
    else:
        qk_norm = target_qk if cfg.draft_arch == "auto" else cfg.draft_arch == "qwen3"
    if target_qk and qk_norm:
        log.info("draft layers: Qwen3 architecture (q_norm/k_norm, as the target), exported as a Qwen3 layer")
    elif qk_norm:
        log.info(
            "draft layers: Qwen3 architecture (q_norm/k_norm, --draft-arch qwen3; the target has none), exported "
            "as a Qwen3 layer"
        )
    elif target_qk and cfg.draft_arch == "llama":
        log.info(
            "draft layers: Llama architecture (--draft-arch llama): the target's q_norm/k_norm are not carried over"
        )
    elif target_qk:
        log.warning(
            "draft layers: Llama architecture (this run started before Qwen3 draft layers): the target's "
            "q_norm/k_norm are not carried over; start a new run for a Qwen3 draft layer"
        )
    return qk_norm


def start_from_target(model: PEagleDraft, cache: Any) -> None:
    """Initialise the draft's fused layer and fc from the target layer the cache stores (`core/target_init.py`);
    a cache without one keeps the random initialisation, with a warning saying how to get it."""
    stored = cache.target_layer()
    if stored is None:
        log.warning(
            "cache %s stores no target layer to start the draft from: random initialisation (a target whose layers "
            "are not Llama ones, as Gemma's, GLM-4's or those with LayerNorms, or are quantised in a form not read here "
            "(AWQ's GEMV layout, 3-bit packings); or a cache written before the layer was stored: re-extract it)",
            cache.path,
        )
        return
    index, tensors = stored
    norms = "self_attn.q_norm.weight" in tensors
    target_config = cache.target_config()
    added = model.cfg.qk_norm and not norms and not has_qk_norm(target_config)
    if added:  # a Qwen3-style draft of a target without QK-norm: its norms start at 1
        tensors = {**tensors, **_unit_qk_norms(model)}
    elif model.cfg.qk_norm and not norms:
        log.warning(
            "cache %s stores target layer %d without its q_norm/k_norm (written before they were stored): the "
            "draft's QK norms start at 1; re-extract it to start them from the target",
            cache.path,
            index,
        )
        tensors = {**tensors, **_unit_qk_norms(model)}
    init_from_target_layer(model, tensors)
    attention_only = "mlp.down_proj.weight" not in tensors
    act = mlp_activation(target_config)
    why = "is a mixture of experts" if act == "silu" else f"uses {act}, not silu"
    part = f"'s attention (its MLP {why}: the draft's MLP starts at zero output)"
    with_norms = " with its q_norm/k_norm" if model.cfg.qk_norm and norms else ""
    with_norms = ", the draft's q_norm/k_norm at 1 (the target has none)" if added else with_norms
    dropped = "; the target's q_norm/k_norm are not carried over" if norms and not model.cfg.qk_norm else ""
    gate = has_gated_attention(target_config)
    log.info(
        "draft layer 0 starts from target layer %d%s%s%s%s; fc passes the last aux state through%s",
        index,
        part if attention_only else "",
        with_norms,
        ", without its attention's output gate (the draft's attention has none)" if gate else "",
        "" if has_rope(target_config, index) else ", a layer without RoPE (the draft's attention rotates)",
        dropped,
    )


def _unit_qk_norms(model: PEagleDraft) -> dict[str, torch.Tensor]:
    """Unit q/k norm weights [D] (the draft's own initialisation) for a stored target layer that lacks them."""
    D = model.cfg.head_dim
    return {"self_attn.q_norm.weight": torch.ones(D), "self_attn.k_norm.weight": torch.ones(D)}


def require_last_hidden(target: str, meta: Any, label: str) -> None:
    """Exact targets are computed from the stored last hidden state: refuse a cache (`label`) that has none.

    Raises:
        BadConfig: target "exact" and `meta.has_last_hidden` false.
    """
    if target == "exact" and not meta.has_last_hidden:
        raise BadConfig(
            f"target=exact needs last hidden states, but {label} has none: re-extract it with --last-hidden "
            "or use target=topk"
        )


def choose_mask_token(cache: Any, embedding_rows: int, override: int | None) -> vocab.MaskTokenChoice:
    """The mask token of a draft trained on `cache` (docs/reference/algorithm.md), logged with the rule that chose it.

    Uses the cache's tokenizer facts (special tokens, ids its chat template produces; `stages.tokenizer_facts`)
    and the counts of every token in the cached samples, so a special token that occurs in the data is never chosen
    by rule.
    """
    from peagle_pipeline.stages.tokenizer_facts import cache_tokenizer_facts

    choice = vocab.choose_mask_token_id(
        cache_tokenizer_facts(cache),
        embedding_rows,
        torch.from_numpy(cache.all_token_counts()),
        override=override,
    )
    log.debug("mask_token_id %d: %s", choice.token_id, choice.rule)
    if choice.warning:
        log.warning(choice.warning)
    return choice


def vocab_coverage(token_counts: Any, dvocab: vocab.DraftVocab | None) -> tuple[int, int]:
    """(supervised tokens whose id is in the draft vocabulary, all supervised tokens).

    Args:
        token_counts: int array [V] of supervised-token counts (`Cache.token_counts()`).
        dvocab: the draft vocabulary, or None when it is the whole target vocabulary.
    """
    counts = torch.as_tensor(token_counts).to(torch.long)
    total = int(counts.sum())
    return (total if dvocab is None else int(counts[dvocab.ids].sum())), total


def describe_vocab_coverage(cache: Any, dvocab: vocab.DraftVocab | None) -> str:
    """One line for the start of training: how much of the supervised text the draft vocabulary can emit."""
    inside, total = vocab_coverage(cache.token_counts(), dvocab)
    V = int(cache.meta.vocab_size)
    size = V if dvocab is None else dvocab.size
    return (
        f"draft vocabulary: {size} of {V} target tokens, covering {inside / max(total, 1):.1%} of the "
        f"{total} supervised tokens in the cache"
    )


def describe_mask_token(cache: Any, mask_token_id: int) -> str:
    """One line for the start of training: the mask token and how often it occurs in the cached samples."""
    seen = int(cache.all_token_counts()[mask_token_id]) if mask_token_id < cache.meta.vocab_size else 0
    return f"mask token: id {mask_token_id} ({_token_name(cache, mask_token_id)}), seen {seen} times in the cached samples"


def _token_name(cache: Any, token_id: int) -> str:
    """The token string of `token_id` from the cache's tokenizer facts (the tokenizer is loaded only for an id they
    do not name: an explicit mask_token_id that is an ordinary token), or "an unused embedding row"."""
    from peagle_pipeline.stages.tokenizer_facts import cache_tokenizer_facts

    facts = cache_tokenizer_facts(cache)
    if token_id >= facts.length:
        return "an unused embedding row"
    return facts.names.get(token_id) or str(cache.tokenizer().convert_ids_to_tokens(token_id))
