"""A trained draft on another cache: the trainer's acceptance estimate, and how it copies from the context.

    python experiments/draft_on_cache.py RUN CACHE [--samples N] [--depths K] [--json OUT]

RUN is a `train` output folder (its latest checkpoint and train.yaml); CACHE a cache of the same target, e.g. the
target's own greedy replies to MT-Bench (`generate --temperature 0` on the MT-Bench questions, then `extract`).
Every usable sample of CACHE is held out (or its first N), and only reply tokens count (`loss_positions:
assistant`), so on the target's greedy replies the estimate reads close to what vLLM measures on them
(docs/results/what-we-learned.md, "What the draft does with text the context spells out": 1.301 against 1.278 in vLLM for
`make demo`'s draft, 80 MT-Bench first turns, 64 new tokens). It takes seconds on 2 cores: a screen between vLLM
runs, not a replacement for them.

Printed: the estimate (mean over anchors of 1 + the leading correct depths of a full-depth chain), vLLM's walk over
the same replies (`core.loss.acceptance_walk`: on the target's greedy replies, the AL vLLM measures, 1.406 against
1.404 in bench/results/cod-cpu-2026-11-27), per-depth top-1 agreement, and the estimate and depth-0 agreement split
by the bigram copy rule (`core/copying.py`): positions whose next token the rule gets right from the context, gets
wrong, or has no guess for. `--depths K` measures a draft trained at more depths as vLLM serving K speculative
tokens does (`export --speculative-tokens K`): only its depths 0..K-1 count. A class without positions (e.g.
replies that never repeat a pair of tokens of their context) prints `-` for its figures (null in --json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from peagle_pipeline.cache.reader import open_cache  # noqa: E402
from peagle_pipeline.config import TrainConfig, resolve  # noqa: E402
from peagle_pipeline.core import loss, partition  # noqa: E402
from peagle_pipeline.core.copying import COPY_NONE, COPY_RIGHT, COPY_WRONG, copy_classes  # noqa: E402
from peagle_pipeline.core.heldout import DataSplit  # noqa: E402
from peagle_pipeline.errors import PeagleError  # noqa: E402
from peagle_pipeline.stages.train.distributed import Dist  # noqa: E402
from peagle_pipeline.stages.train.held_out_eval import eval_plans  # noqa: E402
from peagle_pipeline.stages.train.packed_batch import read_packed  # noqa: E402
from peagle_pipeline.stages.train.trainer import Trainer  # noqa: E402

CLASSES = ("copy right", "copy wrong", "no copy guess")


def held_out_everything(cache: object, samples: int | None) -> DataSplit:
    """Every usable sample of `cache` (or its first `samples`) as the held-out set."""
    table = cache.samples  # type: ignore[attr-defined]
    usable = (table["num_supervised"].to_numpy() > 0) & (table["length"].to_numpy() > 1)
    ids = np.sort(table["sample_id"].to_numpy(dtype=np.int64)[usable])[:samples]
    lengths = table.set_index("sample_id").loc[ids, "length"].to_numpy(dtype=np.int64) - 1
    empty = np.zeros(0, dtype=np.int64)
    return DataSplit(empty, empty, ids, lengths, skipped_unsupervised=int((~usable).sum()))


@torch.no_grad()
def measure(trainer: Trainer, depths: int | None = None) -> dict[str, object]:
    """Per copy class: anchors, depth-0 agreement and the acceptance estimate; and per-depth agreement overall.
    The estimate and the walk count the first `depths` depths (default: all the draft's)."""
    K = trainer.cfg.depths
    served = K if depths is None else depths
    model = trainer.model.eval()
    n = {c: 0 for c in CLASSES}
    d0 = {c: 0 for c in CLASSES}
    accepted = {c: 0 for c in CLASSES}
    correct, total = torch.zeros(K, dtype=torch.long), torch.zeros(K, dtype=torch.long)
    walk_accepted, walk_steps = 0, 0
    plans = eval_plans(trainer)  # the trainer's own packing of held-out samples
    for i, plan in enumerate(plans):
        batch = read_packed(trainer.eval_cache, plan, -1, i, trainer.cfg.target == "exact", False)
        p = trainer.prepare(batch, full=True)
        if not p.segments:
            continue
        lay = p.layout
        whole = partition.Segment(index=torch.arange(len(lay)), owned=torch.ones(len(lay), dtype=torch.bool))
        out = trainer.forward_segment(p, whole, model)
        correct += out.correct.cpu()
        total += out.total.cpu()
        run = loss.leading_correct(lay, out.element_correct, out.element_valid, served)  # per anchor
        a, st = loss.acceptance_walk(lay, out.element_correct & out.element_valid, p.valid, served)
        walk_accepted, walk_steps = walk_accepted + a, walk_steps + st
        anchors = out.element_valid[: lay.rows] & (lay.depth[: lay.rows] == 0)
        # shifted row r of a sample holds token x_{r+1} and predicts x_{r+2}: the rule's verdict at that row
        cls = copy_classes(batch.input_ids, batch.doc_lengths)
        for c, name in zip((COPY_RIGHT, COPY_WRONG, COPY_NONE), CLASSES, strict=True):
            sel = anchors & (cls == c)
            n[name] += int(sel.sum())
            d0[name] += int((run[sel] > 0).sum())
            accepted[name] += int(run[sel].sum())
    anchors_total = sum(n.values())
    return {
        "depths": served,
        "samples": len(trainer.eval_set.eval_ids),
        "anchors": anchors_total,
        "acceptance": 1 + sum(accepted.values()) / max(anchors_total, 1),
        "acceptance_walk": 1 + walk_accepted / walk_steps if walk_steps else None,
        "agreement": [c / t if t else None for c, t in zip(correct.tolist(), total.tolist(), strict=True)],
        "by_copy_rule": {
            name: {
                "share": n[name] / max(anchors_total, 1),
                "depth0_agreement": d0[name] / n[name] if n[name] else None,
                "acceptance": 1 + accepted[name] / n[name] if n[name] else None,
            }
            for name in CLASSES
        },
    }


def _figure(value: float | None) -> str:
    """A figure to 3 decimals, or "-" for one that has no anchors to count."""
    return "-" if value is None else f"{value:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a train output folder")
    ap.add_argument("cache", help="a cache of the same target (every usable sample is held out)")
    ap.add_argument("--samples", type=int, default=None, help="only the first N usable samples")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument(
        "--depths", type=int, default=None, help="count only depths 0..K-1 (vLLM serving K tokens)"
    )
    args = ap.parse_args()
    cfg = resolve(
        TrainConfig,
        Path(args.run) / "train.yaml",
        {"eval_cache": args.cache, "loss_positions": "assistant", "device": "cpu", "export": False},
    )
    if args.depths is not None and not 1 <= args.depths <= cfg.depths:
        print(f"error: --depths {args.depths}: the draft was trained at K = {cfg.depths}", file=sys.stderr)
        return 2
    trainer = Trainer(cfg, Dist.setup("cpu"))
    if not trainer.restore():
        print(f"error: {args.run} has no complete checkpoint", file=sys.stderr)
        return 2
    trainer.eval_cache = open_cache(args.cache, check=True)
    trainer.eval_set = held_out_everything(trainer.eval_cache, args.samples)
    fig = measure(trainer, args.depths)
    print(
        f"{args.run} (step {trainer.step}, K {fig['depths']} of {cfg.depths}) on {args.cache}: "
        f"{fig['samples']} samples, {fig['anchors']} anchors"
    )
    agreement = " ".join(map(_figure, fig["agreement"]))  # type: ignore[call-overload]
    print(
        f"estimated acceptance length {fig['acceptance']:.3f} (vLLM's walk {_figure(fig['acceptance_walk'])}); "  # type: ignore[arg-type]
        f"agreement per depth {agreement}"
    )
    print("bigram copy rule   share  depth-0 agreement  estimated AL")
    for name, row in fig["by_copy_rule"].items():  # type: ignore[union-attr]
        # a class with no anchors (e.g. replies that never repeat a pair of the context) has no figures: "-"
        a, e = (_figure(row[k]) for k in ("depth0_agreement", "acceptance"))
        print(f"{name:17s}  {row['share']:.3f}  {a:>17}  {e:>12}")
    if args.json:
        args.json.write_text(
            json.dumps({"run": args.run, "cache": args.cache, "step": trainer.step, **fig}, indent=1)
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PeagleError as err:  # a missing run, another target's cache: one line, its exit code
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
