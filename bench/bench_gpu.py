"""GPU figures on one CUDA device (the GPU tier: scripts/gpu_tier.sh runs it after `pytest -m gpu`).

  - sequence partitioning: peak CUDA memory of one bf16 training step (SmolLM2-sized draft, K 8, one sample per
    packed row) with 1 and 4 segments at 8k, 16k and 32k tokens, losses compared;
  - training throughput: tokens/s of that step at --train-tokens, bf16 autocast and fp32, compiled flex BlockMask;
  - extraction: `HFBackend.forward` (+ conversion to the stored bf16) vs the bare `model(input_ids)` forward over
    the same padded batches, on a randomly initialised SmolLM2-sized Llama (no weights can be fetched there).
Our step vs speculators' P-EAGLE step on the same GPU is bench_speculators.py --device cuda (needs the wheel).
Correctness (flex = dense, DDP, CUDA extraction = CPU fp32 cache) is tests/gpu's job, not this script's.

    python -m bench.bench_gpu --out gpu.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench.bench_dtype import train_step
from bench.bench_step import SMOLLM2, build_setup


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cuda_setup(
    tokens: int, samples: int, depths: int, layers: int = 1, seed: int = 0, device: str = "cuda"
) -> tuple:
    """bench_step's packed row and SmolLM2-sized draft, moved to `device` (the current CUDA device)."""
    dev = torch.device(device)
    model, vocab, lay, toks, aux, weight, ids, lp, docs = build_setup(
        tokens, samples, depths, seed, layers=layers
    )
    return (
        model.to(dev),
        vocab,
        lay.to(dev),
        toks.to(dev),
        aux.to(dev),
        weight.to(dev),
        ids.to(dev),
        lp.to(dev),
        docs,
    )


def partition_memory(tokens: int, depths: int, segments: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    """Peak CUDA memory (MiB above the resident model, grads and batch) of one bf16 step per segment count."""
    setup = cuda_setup(tokens, 1, depths)
    model = setup[0]
    for p in model.parameters():  # gradients exist before a step in a training loop: not part of the peak
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    train_step(setup, "bf16", depths, segments[0], zero_grad=False)  # compile and warm the allocator
    runs = []
    for n in segments:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            loss = train_step(setup, "bf16", depths, n, zero_grad=False)
            torch.cuda.synchronize()
            runs.append(
                {"segments": n, "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20, "loss": loss}
            )
        except torch.cuda.OutOfMemoryError:
            runs.append({"segments": n, "peak_mib": None, "loss": None, "error": "out of memory"})
        torch.cuda.empty_cache()
    peaks = [r["peak_mib"] for r in runs]
    return {
        "tokens_per_sample": tokens,
        "elements": len(setup[2]),
        "runs": runs,
        "ratio": peaks[0] / peaks[-1] if None not in peaks else None,
    }


def train_throughput(tokens: int, depths: int, repeat: int, device: str = "cuda") -> dict[str, Any]:
    """Tokens/s of one step (forward, loss, backward) in bf16 autocast and in fp32, median of `repeat`."""
    dev = torch.device(device)
    setup = cuda_setup(tokens, max(1, tokens // 2048), depths, device=device)
    out: dict[str, Any] = {"tokens": tokens, "elements": len(setup[2])}
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in ("bf16", "fp32"):
        train_step(setup, dtype, depths)  # warm-up: compiles the mask and flex kernels
        times = []
        for _ in range(repeat):
            _sync(dev)
            t = time.perf_counter()
            train_step(setup, dtype, depths)
            _sync(dev)
            times.append(time.perf_counter() - t)
        out[f"{dtype}_tokens_per_s"] = tokens / statistics.median(times)
    return out


def random_target(out_dir: Path, layers: int = 30) -> Path:
    """A randomly initialised SmolLM2-sized Llama saved in bf16 (the architecture matters here, not the weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in SMOLLM2.items() if k not in ("model_type", "rope_parameters")}
    config = LlamaConfig(**cfg, num_hidden_layers=layers, rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def extraction_throughput(
    batches: int, batch_size: int, max_len: int, device: str = "cuda"
) -> dict[str, Any]:
    """Extraction forward (+ storage conversion) vs bare forward tokens/s over the same batches (alternating)."""
    from peagle_pipeline.backends.hf import HFBackend
    from peagle_pipeline.cache.writer import SampleRecord
    from peagle_pipeline.config import ExtractConfig
    from peagle_pipeline.stages.extract.batch_pipeline import to_sample_data
    from peagle_pipeline.stages.extract.batch_plan import PlannedSample
    from peagle_pipeline.stages.extract.settings import backend_settings

    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_target(Path(tmp) / "target")
        cfg = ExtractConfig(model=str(model_dir), data=["unused"], output="unused", device=device)
        backend = HFBackend(backend_settings(cfg), [2, 15, 27])
        # to_sample_data reads only these fields of the cache metadata (stored bf16, top-32, no last hidden)
        meta = SimpleNamespace(topk=cfg.topk, hidden_dtype="bfloat16", has_last_hidden=False)
        plan = []
        for _ in range(batches):
            lengths = torch.randint(max_len // 4, max_len + 1, (batch_size,), generator=g).tolist()
            ids = [torch.randint(0, SMOLLM2["vocab_size"], (n,), generator=g).tolist() for n in lengths]
            plan.append(ids)
        backend.forward(plan[0][:2]), backend.bare_forward(plan[0][:2])  # warm-up
        seconds = {"extract": 0.0, "bare": 0.0}

        def extract(ids: list[list[int]]) -> None:
            for i, out in enumerate(backend.forward(ids)):
                sample = PlannedSample(i, SampleRecord(i, "x", i), ids[i], [True] * len(ids[i]))
                to_sample_data(sample, out, meta)

        def bare(ids: list[list[int]]) -> None:
            backend.bare_forward(ids)

        for i, ids in enumerate(plan):
            for name, fn in (("extract", extract), ("bare", bare))[:: 1 if i % 2 else -1]:
                _sync(backend.device)
                t = time.perf_counter()
                fn(ids)
                _sync(backend.device)
                seconds[name] += time.perf_counter() - t
        backend.close()
    tokens = sum(len(x) for ids in plan for x in ids)
    return {
        "tokens": tokens,
        "extract_tokens_per_s": tokens / seconds["extract"],
        "bare_tokens_per_s": tokens / seconds["bare"],
        "ratio": seconds["bare"] / seconds["extract"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test; figures not meaningful)")
    ap.add_argument("--depths", type=int, default=8)
    ap.add_argument("--train-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--smoke-cpu", action="store_true", help="run the throughput code on CPU at toy sizes (a check)"
    )
    args = ap.parse_args()
    result: dict[str, Any] = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if args.smoke_cpu:
        result["train"] = train_throughput(256, 2, 1, device="cpu")
        result["extract"] = extraction_throughput(2, 2, 32, device="cpu")
        print(json.dumps(result, indent=2))
        return
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return
    import transformers

    result.update(device=torch.cuda.get_device_name(), transformers=transformers.__version__)
    sizes = (1024, 2048) if args.quick else (8192, 16384, 32768)
    result["partition_memory"] = [partition_memory(n, args.depths) for n in sizes]
    result["train"] = train_throughput(1024 if args.quick else args.train_tokens, args.depths, args.repeat)
    result["extract"] = extraction_throughput(
        2 if args.quick else 8, 4 if args.quick else 16, 256 if args.quick else 2048
    )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{result['device']}, torch {result['torch']}\n")
    print("| figure | value |\n|---|---|")
    for r in result["partition_memory"]:
        peaks = ", ".join(f"{x['segments']} seg: {x['peak_mib'] or 0:.0f} MiB" for x in r["runs"])
        print(
            f"| partition memory at {r['tokens_per_sample']} tokens | {peaks} (ratio {r['ratio'] or 0:.2f}) |"
        )
    t, e = result["train"], result["extract"]
    print(
        f"| training step tokens/s ({t['tokens']}) | bf16 {t['bf16_tokens_per_s']:.0f}, fp32 {t['fp32_tokens_per_s']:.0f} |"
    )
    print(
        f"| extraction vs bare forward | {e['ratio']:.2f}x ({e['extract_tokens_per_s']:.0f} vs {e['bare_tokens_per_s']:.0f}) |"
    )


if __name__ == "__main__":
    main()
