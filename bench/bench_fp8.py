"""fp8 aux-state storage (`extract --dtype fp8`) vs the lossless cache and the per-sample format: bytes per token
and reconstruction error.

One real HF extraction (bf16 hidden states, compress none) feeds, through the real writer: our lossless cache
(bf16, compress auto: the default) and our fp8 cache (e4m3 + an fp32 scale per token and layer, core/fp8.py,
compress auto); and the common per-sample format of bench_cache.py (one safetensors file per sample: ids, mask,
aux states [T, 3H] and the last hidden state [T, H], bf16), plus the same files without the last hidden state
(the like-for-like size). Error: the fp8 aux states read back against the bf16 ones (relative L2 per aux layer,
worst row's relative L2, and the share of values off by more than 2**-4 relative + half a subnormal step).
Prints a Markdown table; writes JSON to --out.

    python -m bench.bench_fp8 --out bench/results/fp8.json [--model DIR --data FILE --samples 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench.bench_cache import dir_bytes, extract_source, write_per_sample
from bench.common import DEMO_DATA, DEMO_MODEL
from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.cache.verify import verify_cache
from peagle_pipeline.cache.writer import CacheWriter, SampleData, SampleRecord
from peagle_pipeline.core import fp8


def rewrite(src, out: Path, hidden_dtype: str) -> Path:
    """Our cache (compress auto, no last hidden) from the source's bf16 arrays, aux stored as `hidden_dtype`."""
    import torch

    meta = CacheMeta.from_dict(
        {**src.meta.to_dict(), "has_last_hidden": False, "compress": "auto", "hidden_dtype": hidden_dtype}
    )
    out.mkdir(parents=True)
    (out / layout.CACHE_META).write_text(json.dumps(meta.to_dict()))
    w = CacheWriter(out, meta, 0, 1).open()
    for ordinal, row in enumerate(src.samples.itertuples(index=False)):
        a = src.read_arrays(int(row.sample_id))
        aux = a["aux_hidden"]
        if hidden_dtype == layout.FP8:
            aux = fp8.encode_rows(torch.from_numpy(aux).view(torch.bfloat16)).numpy()
        data = SampleData(a["input_ids"], a["loss_mask"], aux, a["topk_ids"], a["topk_logprobs"])
        w.add(
            ordinal,
            SampleRecord(int(row.sample_id), row.source, int(row.source_row), bool(row.truncated)),
            data,
        )
    w.close()
    return out


def errors(src, lossy) -> dict[str, object]:
    """fp8 read-back against the bf16 source, over every token of every sample."""
    import torch

    n_aux = len(src.meta.aux_layer_ids)
    num, den = torch.zeros(n_aux, dtype=torch.float64), torch.zeros(n_aux, dtype=torch.float64)
    worst_row, outside, values = 0.0, 0, 0
    for sid in src.samples["sample_id"].tolist():
        x = src.read_sample(int(sid)).aux_hidden.float()  # [T, n_aux, H]
        y = lossy.read_sample(int(sid)).aux_hidden.float()
        err = y - x
        num += err.square().sum((0, 2)).double()
        den += x.square().sum((0, 2)).double()
        row = err.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)  # [T, n_aux]
        worst_row = max(worst_row, float(row.max()))
        scale = x.abs().amax(-1, keepdim=True) / fp8.FP8_MAX
        # bound of core/fp8.py plus the bf16 rounding of the read-back
        bound = 2**-4 * x.abs() + 2**-10 * scale + 2**-8 * y.abs()
        outside += int((err.abs() > bound).sum())
        values += x.numel()
    rel = (num / den).sqrt()
    return {
        "rel_l2_per_layer": [round(float(v), 5) for v in rel],
        "rel_l2": float((num.sum() / den.sum()).sqrt()),
        "worst_row_rel_l2": worst_row,
        "values_outside_bound": outside,
        "values": values,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--samples", type=int, default=16, help="conversations to extract")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes (4 conversations, 256 tokens)")
    ap.add_argument("--workdir", default=None, help="keep outputs here (default: a temp dir, removed)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.max_length = 4, 256
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-fp8-"))
    try:
        src_dir = work / "source"
        extract_source(src_dir, args.model, args.data, args.samples, args.max_length)
        src = open_cache(src_dir)
        for d in ("ours-bf16", "ours-fp8", "per-sample", "per-sample-aux"):
            shutil.rmtree(work / d, ignore_errors=True)
        lossless = open_cache(rewrite(src, work / "ours-bf16", "bfloat16"))
        lossy = open_cache(rewrite(src, work / "ours-fp8", layout.FP8))
        assert verify_cache(lossless) == [] and verify_cache(lossy) == []
        files = write_per_sample(src, work / "per-sample")
        (work / "per-sample-aux").mkdir()
        from safetensors.torch import load_file, save_file

        for path in files.values():
            t = load_file(str(path))
            t.pop("last_hidden_state")
            save_file(t, str(work / "per-sample-aux" / path.name))
        tokens = int(src.samples["length"].sum())
        size = {
            "ours-bf16 (lossless, default)": dir_bytes(work / "ours-bf16" / layout.STORES_DIR) / tokens,
            "ours-fp8": dir_bytes(work / "ours-fp8" / layout.STORES_DIR) / tokens,
            "per-sample (aux + last hidden)": dir_bytes(work / "per-sample") / tokens,
            "per-sample (aux only)": dir_bytes(work / "per-sample-aux") / tokens,
        }
        err = errors(src, lossy)
        result = {
            "model": args.model,
            "samples": len(src.samples),
            "tokens": tokens,
            "aux_layers": src.meta.aux_layer_ids,
            "hidden_size": src.meta.hidden_size,
            "topk": src.meta.topk,
            "bytes_per_token": size,
            "fp8_vs_lossless": size["ours-fp8"] / size["ours-bf16 (lossless, default)"],
            "fp8_vs_per_sample": size["ours-fp8"] / size["per-sample (aux + last hidden)"],
            "fp8_vs_per_sample_aux": size["ours-fp8"] / size["per-sample (aux only)"],
            "error": err,
        }
        print(
            f"\n{len(src.samples)} samples, {tokens} tokens, H={src.meta.hidden_size}, aux {src.meta.aux_layer_ids}, "
            f"top-{src.meta.topk}\n"
        )
        print("| format | bytes/token | vs ours-fp8 |\n|---|---:|---:|")
        for k, v in size.items():
            print(f"| {k} | {v:.0f} | {v / size['ours-fp8']:.2f}x |")
        print(
            f"\nfp8 read-back vs bf16: relative L2 {err['rel_l2']:.4f} (per aux layer {err['rel_l2_per_layer']}), "
            f"worst row {err['worst_row_rel_l2']:.4f}, {err['values_outside_bound']} of {err['values']} values "
            "outside the bound"
        )
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
