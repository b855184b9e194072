"""Training step vs the P-EAGLE training step of PyPI `speculators==0.9.0`, same configuration and batch (goal >= 1.0x).

Runs in the benchmark-only env `.venv-bench` (`make setup-bench`): speculators is called as a library, never
vendored. Both sides get the same SmolLM2-sized draft (H 576, 9 heads / 3 KV heads, head_dim 64, 1 layer,
V 49152, Vd 32000, K 8) with the SAME weights (ours copied into theirs: the state-dict keys are the export keys),
the same packed row (one sample; tokens, aux states, loss mask, verifier last hidden states) and the SAME COD
elements: speculators samples them inside `forward` from torch's global generator, ours from an explicit
generator seeded identically; the bench checks the two element lists are equal and that the losses and the fc
gradients agree, so both sides compute the same step.

Target: speculators' P-EAGLE trains on exact targets only (verifier lm_head rows over the draft vocabulary of
the normed last hidden state), so the headline ratio uses our exact-target step (`target: exact`); our default
top-k step on the same layout is reported beside it. CPU settings of speculators: attention `sdpa` (dense bool
mask from its own mask_mod; its default flex attention has no CPU backward) and the `eager` KL loss (its fused
loss needs Triton). Both in fp32, or both under bf16 autocast (`--precision bf16`, fp32 master weights, as our
trainer's bf16). Tokens/s counts the packed row's shifted tokens; each step includes COD
sampling, the mask, forward, loss and backward. Goal: ours / speculators >= 1.0.
On a GPU (`--device cuda`, run by scripts/gpu_tier.sh) both sides use their CUDA attention: our compiled flex
BlockMask and speculators' flex attention; its COD draws then come from the CUDA generator, so the element lists
may differ from ours (reported as `same_cod_elements`).
`--size 8b` gives both sides a Llama-3.1-8B-sized draft instead (H 4096, 32 / 8 heads, head_dim 128, V 128256,
Vd 32000, random weights; aux ids [2, 16, 29]); `--vocab-size` shrinks V for a CPU smoke run of that path.

    .venv-bench/bin/python -m bench.bench_speculators --out bench/results/speculators.json [--quick]
    python -m bench.bench_speculators --device cuda --size 8b --precision bf16 --tokens 8192 --out OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.bench_step import SMOLLM2  # one SmolLM2-sized draft config for both step benchmarks
from bench.reference_step import tiny_draft
from peagle_pipeline.core.cod import CODConfig, build_layout
from peagle_pipeline.core.loss import Counted, kl_exact, kl_topk
from peagle_pipeline.core.partition import forward_segment, plan_segments

# A Llama-3.1-8B-sized draft layer and vocabulary (the rope is the plain one: its scaling is irrelevant here).
LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
SIZES = {
    "smollm2": (SMOLLM2, [2, 15, 27]),
    "8b": (LLAMA_8B, [2, 16, 29]),
}  # config, default aux ids (L 30 / 32)


def make_batch(L: int, seed: int, config: dict[str, Any], topk: int = 32) -> dict[str, torch.Tensor]:
    """One shifted packed row of L tokens (a single sample): multi-turn supervision pattern, random states."""
    g = torch.Generator().manual_seed(seed)
    H, V = config["hidden_size"], config["vocab_size"]
    weight = torch.zeros(L, dtype=torch.bool)
    turn = 256  # each 256-token turn: 30 % user prompt (unsupervised), then 70 % supervised reply
    for start in range(0, L, turn):
        weight[start + int(turn * 0.3) : start + turn] = True
    return {
        "tokens": torch.randint(0, V, (L,), generator=g),
        "aux": torch.randn(L, 3 * H, generator=g),
        "last_hidden": torch.randn(L, H, generator=g),
        "weight": weight,
        "topk_ids": torch.randint(0, V, (L, topk), generator=g),
        "topk_logprobs": torch.log_softmax(torch.randn(L, topk, generator=g) * 3, -1)
        .sort(-1, descending=True)
        .values,
    }


def build_speculators(
    ours: torch.nn.Module,
    target_norm: torch.Tensor,
    depths: int,
    attn: str = "sdpa",
    config: dict[str, Any] = SMOLLM2,
    aux_layers: list[int] = SIZES["smollm2"][1],
) -> torch.nn.Module:
    """speculators' PEagleDraftModel with our draft's configuration and weights (CPU: sdpa attention)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    cfg = ours.cfg
    layer_cfg = LlamaConfig(
        **{k: v for k, v in config.items() if k != "model_type"},
        num_hidden_layers=len(ours.layers),
        pad_token_id=None,  # ours has no padding row in the embedding: same gradients
        attention_bias=False,
        mlp_bias=False,
    )
    layer_cfg._attn_implementation = attn
    spec_cfg = PEagleSpeculatorConfig(
        transformer_layer_config=layer_cfg,
        draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=cfg.norm_before_residual,
        eagle_aux_hidden_state_layer_ids=aux_layers,
        mask_token_id=cfg.mask_token_id,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=depths)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    model = PEagleDraftModel(spec_cfg).float()
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    state["verifier_lm_head.weight"] = state["lm_head.weight"].clone()
    state["verifier_norm.weight"] = target_norm.clone().float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise SystemExit(f"weight names differ from speculators': missing {missing}, unexpected {unexpected}")
    model.embed_tokens.weight.requires_grad_(True)  # P-EAGLE trains embeddings (as ours)
    model.lm_head.weight.requires_grad_(False)
    return model


def our_step(model, vocab, lay, b, target: str, norm_w, eps, depths: int, chunk: int) -> tuple[float, int]:
    """Our core step on one segment: mask, forward, chunked KL (sum / count), backward."""
    ew = lay.element_weight(b["weight"])
    count = int(ew.sum())
    total = 0.0
    for seg in plan_segments(lay, 1, ew):
        hidden, owned = forward_segment(model, lay, seg, b["tokens"], b["aux"])
        t = lay.target[owned]
        if target == "exact":
            out = kl_exact(
                hidden,
                model.lm_head.weight,
                b["last_hidden"][t],
                (norm_w, eps),
                Counted(ew[owned], lay.depth[owned], depths),
                chunk,
            )
        else:
            out = kl_topk(
                hidden,
                model.lm_head.weight,
                b["topk_ids"][t],
                b["topk_logprobs"][t],
                Counted(ew[owned], lay.depth[owned], depths),
                vocab,
                chunk,
            )
        (out.loss_sum / count).backward()
        total += float(out.loss_sum.detach())
    return total / max(count, 1), count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=1024, help="shifted tokens in the packed row (one sample)")
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--max-anchors", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2048, help="our loss chunk (elements), the trainer default")
    ap.add_argument("--quick", action="store_true", help="512 tokens, 1 timed repeat")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (speculators then uses flex attention)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: both under autocast")
    ap.add_argument(
        "--size", choices=sorted(SIZES), default="smollm2", help="the draft's (and target's) sizes"
    )
    ap.add_argument(
        "--vocab-size", type=int, default=None, help="override V (a small CPU smoke run of --size 8b)"
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.quick:
        args.tokens, args.repeat = min(args.tokens, 512), 1
    torch.set_num_threads(args.threads)
    try:
        import speculators
        from speculators.losses import resolve_loss_config
        from speculators.models.peagle.data import generate_cod_sample_indices
    except ImportError as err:
        raise SystemExit(
            f"error: speculators is not importable ({err}); run `make setup-bench`, use .venv-bench/bin/python"
        ) from None

    L, K, seed = args.tokens, args.depths, 1234
    config, aux_layers = SIZES[args.size]
    if args.vocab_size:
        config = {**config, "vocab_size": args.vocab_size}
    model, vocab, pieces = tiny_draft(seed=0, layers=1, draft_vocab=args.draft_vocab, config=config)
    norm_w, eps = pieces["norm.weight"].float(), float(config["rms_norm_eps"])
    attn = "sdpa" if dev.type == "cpu" else "flex_attention"
    theirs = build_speculators(model, norm_w, K, attn, config, aux_layers)
    del pieces
    b = make_batch(L, seed=7, config=config)
    autocast = (
        (lambda: torch.autocast(dev.type, dtype=torch.bfloat16))
        if args.precision == "bf16"
        else contextlib.nullcontext
    )
    cpu_weight = b["weight"]
    model.to(dev), theirs.to(dev)
    b, norm_w = {k: v.to(dev) for k, v in b.items()}, norm_w.to(dev)
    cod = CODConfig(depths=K, max_anchors=args.max_anchors)

    # Same COD elements: speculators draws from the global generator, ours from an explicit one, same seed.
    torch.manual_seed(seed)
    s_anchor, s_depth = generate_cod_sample_indices(
        L, b["weight"][None].float(), K, cod.ratio, cod.ratio_min, max_anchors=args.max_anchors
    )
    lay = build_layout([L], cpu_weight, cod, torch.Generator().manual_seed(seed))
    same_cod = bool(torch.equal(s_anchor.cpu(), lay.anchor) and torch.equal(s_depth.cpu(), lay.depth))
    loss_cfg = resolve_loss_config("kl_div", "eager")
    zeros = torch.zeros(1, L, dtype=torch.long, device=dev)

    def run_ours(target: str) -> tuple[float, int]:
        model.zero_grad(set_to_none=True)
        layout = build_layout([L], cpu_weight, cod, torch.Generator().manual_seed(seed)).to(dev)
        with autocast():
            return our_step(model, vocab, layout, b, target, norm_w, eps, K, args.chunk)

    def run_theirs() -> tuple[float, int]:
        theirs.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with autocast():
            _, loss, metrics = theirs(
                hidden_states=b["aux"][None],
                input_ids=b["tokens"][None],
                document_ids=zeros,
                loss_mask=b["weight"][None].float(),
                verifier_last_hidden_states=b["last_hidden"][None],
                loss_config=loss_cfg,
                max_anchors=args.max_anchors,
                num_depths=K,
            )
            loss.backward()
        return float(loss.detach()), int(sum(int(metrics[f"position_{d}_acc_total"]) for d in range(K)))

    timings: dict[str, list[float]] = {"ours_exact": [], "ours_topk": [], "speculators": []}
    fns = {
        "ours_exact": lambda: run_ours("exact"),
        "ours_topk": lambda: run_ours("topk"),
        "speculators": run_theirs,
    }
    results: dict[str, Any] = {}
    for name, fn in fns.items():  # warm-up (allocator, kernels) and the numbers to compare
        results[name] = fn()
        if name == "ours_exact":
            g_ours = model.fc.weight.grad.clone()
        if name == "speculators":
            g_theirs = theirs.fc.weight.grad.clone()
    # interleaved, rotating order: drift on a shared machine hits all sides alike
    for r in range(args.repeat):
        names = list(fns)
        names = names[r % 3 :] + names[: r % 3]
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            timings[name].append(time.perf_counter() - t0)
    sec = {k: statistics.median(v) for k, v in timings.items()}
    loss_rel = abs(results["ours_exact"][0] - results["speculators"][0]) / abs(results["speculators"][0])
    grad_rel = float((g_ours - g_theirs).norm() / g_theirs.norm())
    res = {
        "speculators_version": speculators.__version__ if hasattr(speculators, "__version__") else "0.9.0",
        "tokens": L,
        "depths": K,
        "draft_vocab": args.draft_vocab,
        "max_anchors": args.max_anchors,
        "elements": len(lay),
        "depth_counts": lay.depth_counts(K),
        "same_cod_elements": same_cod,
        "threads": args.threads,
        "device": str(dev),
        "precision": args.precision,
        "size": args.size,
        "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"],
        "speculators_settings": {
            "attn": attn,
            "loss": "kl_div eager",
            "target": "exact (verifier lm_head)",
        },
        "seconds": sec,
        "tokens_per_s": {k: L / v for k, v in sec.items()},
        "ratio": sec["speculators"] / sec["ours_exact"],
        "ratio_topk": sec["speculators"] / sec["ours_topk"],
        "loss_ours_exact": results["ours_exact"][0],
        "loss_speculators": results["speculators"][0],
        "loss_rel_diff": loss_rel,
        "fc_grad_rel_diff": grad_rel,
        "goal_ratio_min": 1.0,
        "quick": args.quick,
    }
    print(
        f"\n{args.size} draft (H {config['hidden_size']}, V {config['vocab_size']}), {args.precision}, {L} tokens, "
        f"K={K}, Vd={args.draft_vocab}, {len(lay)} COD elements (same in both: {same_cod})\n"
    )
    print("| step | s/step | tokens/s | ours vs this |\n|---|---:|---:|---:|")
    print(
        f"| speculators 0.9.0 P-EAGLE (exact target) | {sec['speculators']:.2f} | {L / sec['speculators']:.0f} | 1.00 |"
    )
    print(
        f"| ours, exact target | {sec['ours_exact']:.2f} | {L / sec['ours_exact']:.0f} | {res['ratio']:.2f} |"
    )
    print(
        f"| ours, top-k target (default) | {sec['ours_topk']:.2f} | {L / sec['ours_topk']:.0f} | {res['ratio_topk']:.2f} |"
    )
    print(
        f"\nloss rel diff {loss_rel:.1e} (ours {results['ours_exact'][0]:.5f}, speculators "
        f"{results['speculators'][0]:.5f}); fc grad rel diff {grad_rel:.1e}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
