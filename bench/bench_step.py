"""Training-step throughput: the optimised core step vs the direct reference step (bench.reference_step), same batch.

CPU, a SmolLM2-sized draft (H 576, 9 heads / 3 KV heads, head_dim 64, V 49152, Vd 32000, 1 layer), random
weights and targets, one packed row of ~2k tokens. Prints a Markdown table and writes JSON to --out.
Usage: python -m bench.bench_step --out bench/results/step.json [--tokens 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.reference_step import reference_step, tiny_draft
from peagle_pipeline.core.cod import CODConfig, build_layout
from peagle_pipeline.core.loss import Counted, kl_topk
from peagle_pipeline.core.partition import forward_segment, plan_segments

SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}


def build_setup(
    tokens: int,
    samples: int,
    depths: int,
    seed: int = 0,
    draft_vocab: int = 32000,
    topk: int = 32,
    layers: int = 1,
):
    """(model, vocab, layout, tokens, aux, weight, topk_ids, topk_logprobs, doc_lengths) for one packed row."""
    model, vocab, _ = tiny_draft(seed=seed, layers=layers, draft_vocab=draft_vocab, config=SMOLLM2)
    g = torch.Generator().manual_seed(seed + 1)
    per = tokens // samples
    docs = [per] * samples
    L = per * samples
    weight = torch.zeros(L, dtype=torch.bool)
    turn = 256  # multi-turn chats: each 256-token turn = 30 % user prompt, then 70 % supervised reply
    for start in range(0, L, turn):
        weight[start + int(turn * 0.3) : start + turn] = True
    toks = torch.randint(0, SMOLLM2["vocab_size"], (L,), generator=g)
    aux = (torch.randn(L, 3 * 576, generator=g)).to(torch.bfloat16)
    # top-k of a peaked random distribution over frequent ids (most land in the draft vocabulary)
    ids = torch.randint(0, SMOLLM2["vocab_size"], (L, topk), generator=g)
    lp = torch.log_softmax(torch.randn(L, topk, generator=g) * 3, -1).sort(-1, descending=True).values
    lay = build_layout(docs, weight, CODConfig(depths=depths), torch.Generator().manual_seed(seed + 2))
    return model, vocab, lay, toks, aux, weight, ids, lp, docs


def optimised_step(
    model, vocab, lay, toks, aux, weight, ids, lp, segments: int = 1, chunk: int = 1024, depths: int = 8
):
    """The core composition: plan -> forward per segment -> chunked KL -> backward per segment."""
    ew = lay.element_weight(weight)
    outs = []
    count = int(ew.sum())
    total = torch.zeros(())
    for seg in plan_segments(lay, segments, ew):
        hidden, owned = forward_segment(model, lay, seg, toks, aux)
        t = lay.target[owned]
        out = kl_topk(
            hidden,
            model.lm_head.weight,
            ids[t],
            lp[t],
            Counted(ew[owned], lay.depth[owned], depths),
            vocab,
            chunk,
        )
        (out.loss_sum / count).backward()
        total += out.loss_sum.detach()
        outs.append(out)
    return total, count - sum(int(o.excluded) for o in outs)


def _time(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, vocab, lay, toks, aux, weight, ids, lp, _ = build_setup(args.tokens, args.samples, args.depths)
    L = int(weight.numel())

    def opt():
        model.zero_grad(set_to_none=True)
        return optimised_step(model, vocab, lay, toks, aux, weight, ids, lp, depths=args.depths)

    def ref():
        model.zero_grad(set_to_none=True)
        return reference_step(model, lay, toks, aux, weight, ids, lp, vocab)

    opt()  # warm-up (allocator, kernels)
    t_opt, (loss_opt, n_opt) = _time(opt, args.repeat)
    g_opt = model.fc.weight.grad.clone()
    ref()
    t_ref, (loss_ref, n_ref) = _time(ref, args.repeat)
    g_ref = model.fc.weight.grad.clone()
    rel = abs(float(loss_opt) - float(loss_ref)) / abs(float(loss_ref))
    grad_rel = float((g_opt - g_ref).norm() / g_ref.norm())
    res = {
        "tokens": L,
        "elements": len(lay),
        "depth_counts": lay.depth_counts(args.depths),
        "threads": args.threads,
        "optimised_s": t_opt,
        "reference_s": t_ref,
        "optimised_tok_s": L / t_opt,
        "reference_tok_s": L / t_ref,
        "speedup": t_ref / t_opt,
        "loss_optimised": float(loss_opt),
        "loss_reference": float(loss_ref),
        "loss_rel_diff": rel,
        "fc_grad_rel_diff": grad_rel,
        "count": n_opt,
        "count_reference": n_ref,
    }
    print("| step | s/step | tokens/s |\n|---|---|---|")
    print(f"| reference (loop mask, full logits, full softmax) | {t_ref:.3f} | {L / t_ref:.0f} |")
    print(f"| optimised (core) | {t_opt:.3f} | {L / t_opt:.0f} |")
    print(
        f"\nspeedup {res['speedup']:.2f}x; {len(lay)} elements; loss rel diff {rel:.1e}; fc grad rel diff "
        f"{grad_rel:.1e}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
