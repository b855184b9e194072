"""Compute dtype on this machine: the dtype `auto` picks (hardware.resolve_compute_dtype) vs the other one, for the
HF extraction forward and for one training step (goal: `auto`'s choice >= 1.0x the other on both).

  - extraction: `HFBackend.forward` (hooks, chunked top-k) + conversion to the stored dtype (bf16 both times) over
    the same padded batches of the demo model and data (planned as `peagle-pipeline extract` plans them);
  - training step: the core step of bench_step.py (SmolLM2-sized draft, one packed row) under bf16 autocast vs
    fp32, composed as the trainer does (autocast around forward + loss, backward outside).
Batches and steps alternate which dtype runs first, to cancel drift on a shared machine. Goal: the chosen dtype is
at least as fast as the other (ratio chosen / other >= 1.0) for both. Prints a Markdown table; writes JSON to --out.

Where bf16 is emulated (a CPU without AMX / AVX512-BF16 units: about 1 % of fp32's matmul speed) the whole bf16
side would take hours, so each path stops once one dtype has spent `--max-seconds` in it: both dtypes are then
timed over the same batches or steps, fewer of them (the JSON says how many), and the warm-up runs on a few tokens.

    python -m bench.bench_dtype --out bench/results/dtype.json [--samples 16 --max-length 512 --tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.bench_step import build_setup
from bench.common import DEMO_DATA, DEMO_MODEL, write_result
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.core.loss import Counted, kl_topk
from peagle_pipeline.core.partition import forward_segment, plan_segments
from peagle_pipeline.data.records import rank_rows
from peagle_pipeline.hardware import cpu_bf16_flags, describe_compute_dtype, resolve_compute_dtype
from peagle_pipeline.stages.extract.batch_pipeline import to_sample_data
from peagle_pipeline.stages.extract.batch_plan import PlannedSample, plan_batches, render_rows
from peagle_pipeline.stages.extract.cache_output import build_meta
from peagle_pipeline.stages.extract.settings import settle

DTYPES = ("bf16", "fp32")
# Tokens of the extraction warm-up: enough to touch every kernel, few enough for an emulated bf16.
WARMUP_TOKENS = 16


def extraction_batches(cfg: ExtractConfig) -> list[list[PlannedSample]]:
    """The padded batches `peagle-pipeline extract` would form for cfg (rank 0 of 1)."""
    from transformers import AutoTokenizer

    from peagle_pipeline.data.chat import ChatRenderer
    from peagle_pipeline.data.formats import iter_rows

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(cfg.model))
    rows = rank_rows(iter_rows(cfg.data), 0, 1, cfg.max_samples)
    plan = plan_batches(render_rows(rows, renderer, cfg.max_length, cfg.overlong), cfg.batch_tokens)
    return [b for b in plan if isinstance(b, list)]


def bench_extraction(args: argparse.Namespace) -> dict[str, float]:
    """Tokens/s of forward + storage conversion per compute dtype, over the same batches."""
    from peagle_pipeline.backends.hf import HFBackend
    from peagle_pipeline.model_dir import read_target_info
    from peagle_pipeline.stages.extract.settings import backend_settings

    base = dict(model=args.model, data=[args.data], output="unused", max_samples=args.samples)
    base.update(max_length=args.max_length, batch_tokens=args.batch_tokens, device="cpu")
    cfgs = {d: ExtractConfig(**base, compute_dtype=d) for d in DTYPES}
    batches = extraction_batches(cfgs["bf16"])
    info = read_target_info(args.model)
    settled = settle(cfgs["bf16"], info, None, "cpu", (0, 1))
    layer_ids = list(settled.layer_ids)
    meta = build_meta(settled)  # only its stored dtypes are used
    backends = {d: HFBackend(backend_settings(cfgs[d]), layer_ids) for d in DTYPES}
    for b in backends.values():
        b.forward([batches[0][0].input_ids[:WARMUP_TOKENS]])  # warm-up (allocator, kernels)
    seconds = dict.fromkeys(DTYPES, 0.0)
    tokens = measured = 0
    for i, batch in enumerate(batches):
        for d in DTYPES if i % 2 == 0 else DTYPES[::-1]:
            t = time.perf_counter()
            for sample, out in zip(batch, backends[d].forward([s.input_ids for s in batch]), strict=True):
                to_sample_data(sample, out, meta)
            seconds[d] += time.perf_counter() - t
        tokens, measured = tokens + sum(len(s.input_ids) for s in batch), measured + 1
        if max(seconds.values()) > args.max_seconds:
            break
    for b in backends.values():
        b.close()
    rates = {d: tokens / seconds[d] for d in DTYPES}
    return {"tokens": tokens, "batches": len(batches), "batches_measured": measured, **rates}


def train_step(
    setup: tuple, dtype: str, depths: int, segments: int = 1, chunk: int = 1024, zero_grad: bool = True
) -> float:
    """One optimizer-free training step (forward, loss, backward per segment) as the trainer composes it, on the
    device the setup's tensors are on (CUDA: the compiled flex BlockMask); returns the loss (sum / count)."""
    model, vocab, lay, toks, aux, weight, ids, lp, _ = setup
    head = getattr(model, "module", model).lm_head.weight  # model may be DDP-wrapped
    if zero_grad:
        model.zero_grad(set_to_none=True)
    aux_in = aux.float() if dtype == "fp32" else aux
    ew = lay.element_weight(weight)
    count = int(ew.sum())
    total = 0.0
    for seg in plan_segments(lay, segments, ew):
        with torch.autocast(toks.device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            hidden, owned = forward_segment(model, lay, seg, toks, aux_in)
            t = lay.target[owned]
            out = kl_topk(
                hidden, head, ids[t], lp[t], Counted(ew[owned], lay.depth[owned], depths), vocab, chunk
            )
        (out.loss_sum / count).backward()
        total += float(out.loss_sum.detach())
    return total / count


def bench_training(args: argparse.Namespace) -> dict[str, float]:
    """Tokens/s of one training step per compute dtype (median of --repeat, alternating order)."""
    setup = build_setup(args.tokens, 2, args.depths)
    tokens = int(setup[5].numel())
    times: dict[str, list[float]] = {d: [] for d in DTYPES}
    losses, warmup = {}, {}
    for d in DTYPES:  # warm-up; its time stands in for the steps when one step is over the cap
        t = time.perf_counter()
        losses[d] = train_step(setup, d, args.depths)
        warmup[d] = time.perf_counter() - t
    spent = dict(warmup)
    for r in range(args.repeat):
        if max(spent.values()) > args.max_seconds:
            break
        for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            t = time.perf_counter()
            train_step(setup, d, args.depths)
            times[d].append(time.perf_counter() - t)
            spent[d] += times[d][-1]
    steps = {d: times[d] or [warmup[d]] for d in DTYPES}
    return {
        "tokens": tokens,
        "steps_measured": len(times["fp32"]),
        **{d: tokens / statistics.median(steps[d]) for d in DTYPES},
        "loss_rel_diff": abs(losses["bf16"] - losses["fp32"]) / abs(losses["fp32"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048, help="training-step packed row length")
    ap.add_argument("--depths", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument(
        "--max-seconds", type=float, default=60.0, help="stop a path once one dtype has spent this long in it"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = resolve_compute_dtype("auto", "cpu")
    other = "fp32" if chosen == "bf16" else "bf16"
    extract = bench_extraction(args)
    train = bench_training(args)
    result = {
        "chosen": chosen,
        "why": describe_compute_dtype("auto", "cpu", chosen),
        "cpu_bf16_flags": list(cpu_bf16_flags()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "extract_tokens_per_s": {d: extract[d] for d in DTYPES},
        "train_tokens_per_s": {d: train[d] for d in DTYPES},
        "extract_ratio": extract[chosen] / extract[other],
        "train_ratio": train[chosen] / train[other],
        "extract_tokens": extract["tokens"],
        "extract_batches_measured": f"{extract['batches_measured']} of {extract['batches']}",
        "train_tokens": train["tokens"],
        "train_steps_measured": train["steps_measured"],
        "time_capped": extract["batches_measured"] < extract["batches"]
        or train["steps_measured"] < args.repeat,
        "train_loss_rel_diff": train["loss_rel_diff"],
        "goal_ratio_min": 1.0,
    }
    print(f"\n{result['why']}; {result['torch_threads']} threads\n")
    print("| path | bf16 tokens/s | fp32 tokens/s | chosen / other |")
    print("|---|---:|---:|---:|")
    for name, key in (
        ("extraction (HF forward + storage conversion)", "extract"),
        ("training step", "train"),
    ):
        rates = result[f"{key}_tokens_per_s"]
        print(f"| {name} | {rates['bf16']:.0f} | {rates['fp32']:.0f} | {result[f'{key}_ratio']:.2f} |")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
