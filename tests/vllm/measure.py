"""Measure the vLLM backend against the HF backend on the same batches: throughput and agreement.

Run in the vLLM environment (not collected by pytest):
    .venv-vllm/bin/python tests/vllm/measure.py --model .demo/models/SmolLM2-135M-Instruct \
        --data .demo/data/sharegpt.jsonl --samples 48 --max-length 512
Prints one JSON object: tokens/s of both backends (engine start excluded, one warm-up batch excluded) and the
agreement figures of `agreement.compare` (aux max abs / relative error, top-k set overlap, top-1 agreement).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agreement import compare, render_samples  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from peagle_pipeline.backends.hf import HFBackend
    from peagle_pipeline.backends.vllm import VLLMBackend
    from peagle_pipeline.config import ExtractConfig
    from peagle_pipeline.model_dir import read_target_info
    from peagle_pipeline.stages.extract.settings import backend_settings
    from peagle_pipeline.target_info import default_layer_ids

    torch.set_num_threads(args.threads)
    cfg = ExtractConfig(
        model=args.model,
        data=[args.data],
        output="unused",
        topk=args.topk,
        last_hidden=True,
        max_length=args.max_length,
        device="cpu",
    )
    layers = default_layer_ids(read_target_info(args.model).num_hidden_layers)
    samples = render_samples(args.model, args.data, args.samples, args.max_length)
    batches: list[list[list[int]]] = [[]]
    for ids in samples:  # greedy fill to batch_tokens padded tokens, in data order (as the runner does)
        cur = batches[-1]
        if cur and (len(cur) + 1) * max(len(ids), *(len(x) for x in cur)) > args.batch_tokens:
            batches.append(cur := [])
        cur.append(ids)

    def timed(backend: object) -> tuple[list, float, int]:
        outs = backend.forward(batches[0])  # type: ignore[attr-defined]  # warm-up, not timed
        t0, n = time.perf_counter(), 0
        for b in batches[1:]:
            outs += backend.forward(b)  # type: ignore[attr-defined]
            n += sum(len(x) for x in b)
        return outs, time.perf_counter() - t0, n

    hf = HFBackend(backend_settings(cfg), layers)
    hf_out, hf_s, n = timed(hf)
    hf.close()
    del hf
    t0 = time.perf_counter()
    vb = VLLMBackend(backend_settings(cfg), layers)
    start_s = time.perf_counter() - t0
    v_out, v_s, _ = timed(vb)
    vb.close()
    report = {
        "model": args.model,
        "samples": len(samples),
        "tokens_timed": n,
        "batches": len(batches),
        "layers": layers,
        "topk": args.topk,
        "threads": args.threads,
        "hf_tokens_per_s": round(n / hf_s, 1),
        "vllm_tokens_per_s": round(n / v_s, 1),
        "vllm_engine_start_s": round(start_s, 1),
        **compare(hf_out, v_out),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
