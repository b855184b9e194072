"""The reference P-EAGLE training step, written the most direct way: a mask built element by element,
explicit attention math (masked softmax), every element through every layer, full [N, Vd] logits and a
full-softmax KL, one segment. It shares only the parameters (a `PEagleDraft`) and the COD layout with the
optimised path, so equivalence tests check the model, the mask, the chunked loss and partitioning together.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from peagle_pipeline.core.cod import CODLayout
from peagle_pipeline.core.model import PEagleDraft
from peagle_pipeline.core.vocab import DraftVocab


def reference_mask(layout: CODLayout) -> torch.Tensor:
    """BoolTensor[N, N] built one query at a time, straight from the mask's definition: an element sees the
    depth-0 elements of its document up to its anchor and the elements of its own anchor up to its depth."""
    a, d, doc = layout.anchor.tolist(), layout.depth.tolist(), layout.doc.tolist()
    n = len(a)
    out = torch.zeros(n, n, dtype=torch.bool)
    A, D, DOC = layout.anchor, layout.depth, layout.doc
    for q in range(n):
        if doc[q] < 0:
            continue  # padding attends nowhere
        same = DOC == doc[q]
        out[q] = same & (((D == 0) & (A <= a[q])) | ((A == a[q]) & (D <= d[q])))
    return out


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    ang = pos.float()[:, None] * inv_freq[None, :]  # [N, D/2], fp32 as transformers and vLLM
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :] * scale
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :] * scale
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference_forward(
    model: PEagleDraft, layout: CODLayout, tokens: torch.Tensor, aux_rows: torch.Tensor
) -> torch.Tensor:
    """[N, H] final-normed hidden states of every element (fp32, no fused kernels)."""
    cfg = model.cfg
    eps, D = cfg.rms_norm_eps, cfg.head_dim
    rope_scale = cfg.rope.attention_factor  # yarn's; 1 for the other RoPE types
    is_mask = layout.depth > 0
    ids = torch.where(is_mask, torch.tensor(cfg.mask_token_id), tokens[layout.target])
    emb = model.embed_tokens.weight[ids]
    aux = torch.where(is_mask[:, None], model.mask_hidden.view(1, -1), aux_rows[layout.target].float())
    stream = aux @ model.fc.weight.T
    mask = reference_mask(layout)
    N = len(layout)
    for i, layer in enumerate(model.layers):
        if i == 0:
            normed = _norm(stream, layer.hidden_norm.weight, eps)
            residual = normed if cfg.norm_before_residual else stream
            x = torch.cat([_norm(emb, layer.input_layernorm.weight, eps), normed], -1)
        else:
            residual, x = stream, _norm(stream, layer.input_layernorm.weight, eps)
        at = layer.self_attn
        q = _rope(
            (x @ at.q_proj.weight.T).view(N, cfg.num_heads, D), layout.position, model.inv_freq, rope_scale
        )
        k = _rope(
            (x @ at.k_proj.weight.T).view(N, cfg.num_kv_heads, D), layout.position, model.inv_freq, rope_scale
        )
        v = (x @ at.v_proj.weight.T).view(N, cfg.num_kv_heads, D)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # padding rows: all -inf -> 0
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(N, cfg.num_heads * D)
        h = residual + o @ at.o_proj.weight.T
        mlp = layer.mlp
        y = _norm(h, layer.post_attention_layernorm.weight, eps)
        stream = (
            h + (F.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        )
    return _norm(stream, model.norm.weight, eps)


def reference_topk_loss(
    model: PEagleDraft,
    hidden: torch.Tensor,
    layout: CODLayout,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    vocab: DraftVocab | None,
) -> tuple[torch.Tensor, int]:
    """Summed KL over weighted elements with full logits and a dense target distribution; and the count."""
    logq = torch.log_softmax(hidden @ model.lm_head.weight.T, -1)  # [N, Vd]
    Vd = logq.shape[1]
    ids = topk_ids[layout.target]
    draft = ids if vocab is None else vocab.target_to_draft[ids]
    p = topk_logprobs[layout.target].exp() * (draft >= 0)
    dense = torch.zeros(len(layout), Vd).scatter_add_(1, draft.clamp_min(0), p)
    z = dense.sum(-1, keepdim=True)
    w = weight[layout.target] & (layout.doc >= 0) & (z[:, 0] > 0)
    dense = dense / z.clamp_min(1e-30)
    kl = (torch.xlogy(dense, dense) - dense * logq).sum(-1)
    return (kl * w).sum(), int(w.sum())


def reference_step(
    model: PEagleDraft,
    layout: CODLayout,
    tokens: torch.Tensor,
    aux_rows: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    vocab: DraftVocab | None,
) -> tuple[torch.Tensor, int]:
    """Forward + loss + backward of one packed row; returns (loss_sum, count). Gradients land in `model`."""
    hidden = reference_forward(model, layout, tokens, aux_rows)
    loss, count = reference_topk_loss(model, hidden, layout, weight, topk_ids, topk_logprobs, vocab)
    (loss / max(count, 1)).backward()
    return loss.detach(), count


# ---- tiny real inputs shared by the core unit tests, the equivalence tests and the benchmarks ----


def tiny_target_config(
    hidden: int = 64,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    vocab: int = 512,
    inter: int = 128,
) -> dict:
    """A Llama-style target config dict (transformers 5 `rope_parameters` form)."""
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def tiny_draft(
    seed: int = 0,
    layers: int = 1,
    draft_vocab: int = 300,
    norm_before_residual: bool = False,
    config: dict | None = None,
    num_aux: int = 3,
):
    """(model, vocab, pieces): a PEagleDraft with random target pieces and a random draft vocabulary."""
    from peagle_pipeline.core.draft_config import DraftConfig
    from peagle_pipeline.core.vocab import build_draft_vocab

    cfg_dict = config or tiny_target_config()
    V, H = cfg_dict["vocab_size"], cfg_dict["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    vocab = build_draft_vocab(torch.randint(0, 1000, (V,), generator=g), draft_vocab)
    pieces = {
        "embed_tokens.weight": torch.randn(V, H, generator=g) * 0.5,
        "lm_head.weight": torch.randn(V, H, generator=g) * 0.3,
        "norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
    }
    cfg = DraftConfig.from_target_config(cfg_dict, layers, num_aux, vocab.size, V - 1, norm_before_residual)
    model = PEagleDraft(cfg, pieces, vocab if not vocab.is_identity else None, generator=g)
    return model, (vocab if not vocab.is_identity else None), pieces


def tiny_batch(
    seed: int,
    doc_lengths: list[int],
    L: int,
    vocab_size: int,
    aux_size: int,
    k: int = 8,
    p_valid: float = 0.7,
):
    """(tokens [L], aux [L, aux_size], weight [L] bool, topk_ids [L, k], topk_logprobs [L, k]) of a packed row."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(L, generator=g) < p_valid
    weight[sum(doc_lengths) :] = False
    tokens = torch.randint(0, vocab_size, (L,), generator=g)
    aux = torch.randn(L, aux_size, generator=g)
    ids = torch.stack([torch.randperm(vocab_size, generator=g)[:k] for _ in range(L)])
    logprobs = torch.log_softmax(torch.randn(L, k, generator=g) * 2, -1).sort(-1, descending=True).values
    return tokens, aux, weight, ids, logprobs
