"""Which 4-bit format to store hidden states in: relative L2 error per aux layer of the read-back states, on a real
extraction, for int4 (absmax), nf4 and e2m1 (fp4) at blocks of 16/32/64 values of the hidden dimension, with block
scales in bf16, fp8-e4m3 (under an fp32 scale per row) or e8m0 (a power of two, as MXFP4), with or without the
largest values of each row kept apart in bf16; fp8 per row (`--dtype fp8`) and the format `--dtype nf4` stores
(core/nf4.py) beside them. Outlier channels are the risk of block scales: the error is also given over the
channels outside the 8 of largest mean magnitude per layer ("rest"), where a block that holds an outlier zeroes
its neighbours.

    .venv/bin/python experiments/quant4_formats.py [--samples 16 --max-length 512 --json OUT]

The source is a real bf16 extraction of the demo model and data (bench/bench_cache.py's `extract_source`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.bench_cache import extract_source
from bench.common import DEMO_DATA, DEMO_MODEL
from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.core import fp8, nf4

NF4 = torch.tensor(
    [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
     0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]
)  # fmt: skip
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1 = torch.cat([-E2M1.flip(0)[:-1], E2M1])
INT4 = torch.arange(-7.0, 8.0)


def _nearest(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    mids = (grid[1:] + grid[:-1]) / 2
    return grid[torch.bucketize(v, mids)]


def _scales(amax: torch.Tensor, top: float, kind: str) -> torch.Tensor:
    """Block scales [..., nb, 1] so that amax maps to `top`, rounded to the scale format."""
    s = amax / top
    if kind == "bf16":
        return s.bfloat16().float()
    if kind == "e8m0":  # power of two at or above (so no value clips)
        return torch.exp2(torch.ceil(torch.log2(s.clamp_min(2.0**-126))))
    if kind == "e4m3":  # e4m3 codes under an fp32 scale per row (as NVFP4's per-tensor scale)
        row = s.amax(dim=-2, keepdim=True).clamp_min(1e-30) / fp8.FP8_MAX
        return (s / row).to(torch.float8_e4m3fn).float() * row
    raise ValueError(kind)


def quantise(
    x: torch.Tensor, grid: torch.Tensor, block: int, scale_kind: str, outliers: int = 0
) -> torch.Tensor:
    """x [..., H] -> read-back x through blocks of `block` values on `grid` with scales of `scale_kind`; the
    `outliers` largest magnitudes of each row kept apart in bf16 (zeroed in the blocks)."""
    if outliers:
        idx = x.abs().topk(outliers, dim=-1).indices
        y = quantise(x.scatter(-1, idx, 0.0), grid, block, scale_kind)
        return y.scatter(-1, idx, torch.gather(x, -1, idx).bfloat16().float())
    *lead, H = x.shape
    b = x.float().reshape(*lead, H // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    s = _scales(amax, float(grid.max()), scale_kind)
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = _nearest((b / s).clamp(float(grid.min()), float(grid.max())), grid)
    return (q * s).reshape(*lead, H).bfloat16().float()


def bits_per_value(block: int, scale_kind: str, H: int, outliers: int = 0) -> float:
    scale_bits = {"bf16": 16, "e8m0": 8, "e4m3": 8}[scale_kind]
    row = 32 if scale_kind == "e4m3" else 0
    return 4 + scale_bits / block + (row + 32 * outliers) / H  # an outlier: uint16 index + bf16 value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--data", default=str(DEMO_DATA))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--workdir", default=None, help="keep (or reuse) the source extraction here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="quant4-"))
    extract_source(work / "source", args.model, args.data, args.samples, args.max_length)
    src = open_cache(work / "source")
    x = torch.cat([src.read_sample(int(s)).aux_hidden.float() for s in src.samples["sample_id"]])  # [N, n, H]
    N, n_aux, H = x.shape
    rest = torch.ones(n_aux, H, dtype=torch.bool)
    for i in range(n_aux):
        rest[i, x[:, i].abs().mean(0).topk(8).indices] = False
    peaks = [float((x[:, i].abs().amax(-1) / x[:, i].norm(dim=-1) * H**0.5).median()) for i in range(n_aux)]
    print(f"{N} tokens, aux layers {src.meta.aux_layer_ids}, H {H}; median row peak/rms per layer {peaks}\n")

    def err(y: torch.Tensor) -> dict[str, list[float]]:
        d = y - x
        full = (d.square().sum((0, 2)) / x.square().sum((0, 2))).sqrt()
        dr, xr = d * rest, x * rest
        part = (dr.square().sum((0, 2)) / xr.square().sum((0, 2))).sqrt()
        return {"all": [round(float(v), 4) for v in full], "rest": [round(float(v), 4) for v in part]}

    rows = [("fp8 e4m3, fp32 scale per row", 8 + 32 / H, err(fp8.decode_rows(fp8.encode_rows(x)).float()))]
    for name, grid in (("int4", INT4), ("nf4", NF4), ("e2m1", E2M1)):
        for scale_kind in ("bf16", "e4m3", "e8m0"):
            for block in (16, 32, 64):
                y = quantise(x, grid, block, scale_kind)
                rows.append(
                    (f"{name}, {scale_kind} scale / {block}", bits_per_value(block, scale_kind, H), err(y))
                )
    for k in (1, 2, 4, 8):
        for name, grid in (("int4", INT4), ("nf4", NF4), ("e2m1", E2M1)):
            for block in (32, 64):
                y = quantise(x, grid, block, "e4m3", outliers=k)
                bits = bits_per_value(block, "e4m3", H, outliers=k)
                rows.append((f"{name}, e4m3 scale / {block}, {k} bf16 outliers per row", bits, err(y)))
    packed = nf4.encode_rows(x)
    rows.append((f"core/nf4.py (`--dtype nf4`): nf4 / {nf4.BLOCK}, {nf4.OUTLIERS} outliers", 8 * packed.shape[-1] / H,
                 err(nf4.decode_rows(packed).float())))  # fmt: skip
    print("| format | bits/value | x bf16 | rel L2 per layer | rel L2, rest (outside top-8 channels) |")
    print("|---|---:|---:|---|---|")
    for name, bits, e in rows:
        print(f"| {name} | {bits:.3f} | {bits / 16:.3f} | {e['all']} | {e['rest']} |")
    if args.json:
        out = {"tokens": N, "aux_layers": src.meta.aux_layer_ids, "hidden_size": H, "peak_over_rms": peaks,
               "rows": [{"format": n, "bits_per_value": b, "rel_l2": e} for n, b, e in rows]}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
