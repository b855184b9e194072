"""torch.profiler traces of the GPU paths of a step and an extraction (experiments/gpu_profile.sh runs it on a GPU).

  - our P-EAGLE training step and speculators' (when it imports), the pair `bench_speculators.py` compares: same
    draft, same packed row, bf16 autocast (or --precision fp32);
  - HF extraction (`stages.extract.batch_pipeline.BatchPipeline`: batch i+1 queued before batch i is copied and
    converted) vs the bare `model(input_ids)` forward over the same batches, on a random SmolLM2-sized target;
  - on CUDA, the host syncs of each (torch's sync debug mode, counted as warnings): a step or a batch that waits
    for the device more often than its comparator shows here.
Writes into --out: `trace_<name>.json.gz` (chrome://tracing / Perfetto), `top_<name>.txt` (the 30 most expensive
ops by device time, by CPU time on a CPU), and `profile.json` (wall seconds per profiled run, sync counts).
On a CPU (`--device cpu --tokens 256 --batches 2`) it is a smoke run of the same code: figures mean nothing.

    python experiments/gpu_profile.py --out DIR [--device cuda] [--tokens 2048] [--precision bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from experiments/: `bench` and the package from the root
    sys.path.insert(0, str(ROOT))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def count_syncs(fn: Callable[[], Any], dev: torch.device) -> int | None:
    """Synchronizing CUDA calls `fn()` makes (None on a CPU)."""
    if dev.type != "cuda":
        fn()
        return None
    sync(dev)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(dev)
    return sum("synchroniz" in str(w.message) for w in seen)


def profile(name: str, fn: Callable[[], Any], dev: torch.device, out: Path, runs: int = 2) -> dict[str, Any]:
    """Warm `fn` up, count its syncs, then trace `runs` calls; writes the trace and the top-ops table."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()  # warm-up: compiles, allocator
    sync(dev)
    syncs = count_syncs(fn, dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=False) as prof:
        t = time.perf_counter()
        for _ in range(runs):
            fn()
        sync(dev)
        seconds = (time.perf_counter() - t) / runs
    raw = out / f"trace_{name}.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    (out / f"top_{name}.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")
    print(f"{name}: {seconds:.4f} s per run, {syncs} syncs", flush=True)
    return {"seconds": seconds, "syncs": syncs}


def training_steps(args: argparse.Namespace, dev: torch.device) -> dict[str, Callable[[], Any]]:
    """Our step (exact target, as speculators trains) and speculators' step, on the same draft and row."""
    from bench.bench_speculators import SIZES, build_speculators, make_batch, our_step
    from bench.reference_step import tiny_draft
    from peagle_pipeline.core.cod import CODConfig, build_layout

    config, aux_layers = SIZES[args.size]
    L, K, seed = args.tokens, 8, 1234
    model, vocab, pieces = tiny_draft(seed=0, layers=1, draft_vocab=32000, config=config)
    norm_w, eps = pieces["norm.weight"].float().to(dev), float(config["rms_norm_eps"])
    b = make_batch(L, seed=7, config=config)
    host_weight = b["weight"]
    b = {k: v.to(dev) for k, v in b.items()}
    cod = CODConfig(depths=K, max_anchors=512)
    autocast = (
        (lambda: torch.autocast(dev.type, dtype=torch.bfloat16))
        if args.precision == "bf16"
        else contextlib.nullcontext
    )

    def ours() -> None:
        model.zero_grad(set_to_none=True)
        lay = build_layout([L], host_weight, cod, torch.Generator().manual_seed(seed)).to(dev)
        with autocast():
            our_step(model, vocab, lay, b, "exact", norm_w, eps, K, 2048)

    steps = {"ours_step": ours}
    try:
        from speculators.losses import resolve_loss_config
    except ImportError:
        print("speculators does not import: our step alone", flush=True)
        model.to(dev)
        return steps
    attn = "sdpa" if dev.type == "cpu" else "flex_attention"
    theirs = build_speculators(model, pieces["norm.weight"].float(), K, attn, config, aux_layers).to(dev)
    model.to(dev)
    loss_cfg = resolve_loss_config("kl_div", "eager")
    zeros = torch.zeros(1, L, dtype=torch.long, device=dev)

    def speculators() -> None:
        theirs.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with autocast():
            _, loss, _ = theirs(
                hidden_states=b["aux"][None],
                input_ids=b["tokens"][None],
                document_ids=zeros,
                loss_mask=b["weight"][None].float(),
                verifier_last_hidden_states=b["last_hidden"][None],
                loss_config=loss_cfg,
                max_anchors=512,
                num_depths=K,
            )
            loss.backward()

    steps["speculators_step"] = speculators
    return steps


def extraction(args: argparse.Namespace, dev: torch.device, work: Path) -> dict[str, Callable[[], Any]]:
    """The extraction pipeline and the bare forward over the same random batches (random SmolLM2-sized target)."""
    from bench.bench_gpu import SMOLLM2, random_target
    from peagle_pipeline.backends.hf import HFBackend
    from peagle_pipeline.cache.writer import SampleRecord
    from peagle_pipeline.config import ExtractConfig
    from peagle_pipeline.stages.extract.batch_pipeline import BatchPipeline
    from peagle_pipeline.stages.extract.batch_plan import PlannedSample
    from peagle_pipeline.stages.extract.settings import backend_settings, resolve_layers

    target = random_target(work / "target", layers=args.target_layers)
    cfg = ExtractConfig(model=str(target), data=["-"], output="-", device=str(dev))
    backend = HFBackend(backend_settings(cfg), resolve_layers(cfg, args.target_layers))
    stored = SimpleNamespace(topk=cfg.topk, hidden_dtype="bfloat16", has_last_hidden=False)
    g = torch.Generator().manual_seed(0)
    per = max(1, args.batch_tokens // args.max_length)
    batches = [
        [
            torch.randint(0, SMOLLM2["vocab_size"], (args.max_length,), generator=g).tolist()
            for _ in range(per)
        ]
        for _ in range(args.batches)
    ]

    class Drop:  # the writer's place: conversion to the stored dtypes is timed, the zarr write is not
        meta = stored

        def add(self, *a: Any) -> None:
            pass

    def pipelined() -> None:
        ahead = BatchPipeline(Drop(), lambda n: None)  # type: ignore[arg-type]
        for i, ids in enumerate(batches):
            ahead.submit(
                backend,
                [
                    PlannedSample(j, SampleRecord(j, "x", j), x, [True] * len(x))
                    for j, x in enumerate(ids, start=i * per)
                ],
            )
        ahead.drain()

    def bare() -> None:
        for ids in batches:
            backend.bare_forward(ids)

    return {"extract": pipelined, "bare_forward": bare}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=2048, help="the training row's shifted tokens")
    ap.add_argument("--size", choices=["smollm2", "8b"], default="smollm2", help="the draft's sizes")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--target-layers", type=int, default=30, help="layers of the random extraction target")
    ap.add_argument("--batches", type=int, default=4, help="extraction batches per profiled run")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--only", default="train,extract", help="comma-separated: train, extract")
    args = ap.parse_args()
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "runs": {},
    }
    work = Path(tempfile.mkdtemp(prefix="gpu-profile-"))
    try:
        parts = {"train": training_steps, "extract": lambda a, d: extraction(a, d, work)}
        for part in args.only.split(","):
            try:
                for name, fn in parts[part](args, dev).items():
                    result["runs"][name] = profile(name, fn, dev, out)
            except Exception as err:  # one part failing still leaves the others' traces
                result["runs"][part] = {"error": f"{type(err).__name__}: {err}"}
                print(f"{part} failed: {type(err).__name__}: {err}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
