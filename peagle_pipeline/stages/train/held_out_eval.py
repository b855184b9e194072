"""The held-out figures of a run: loss, per-depth top-1 agreement and estimated acceptance lengths.

Every held-out sample is laid out at full depth (`core.cod.build_layout(full=True)`) and run through the draft in
one piece; the figures are the trainer's `evaluate` record (`kind: eval` in metrics.jsonl). Reads the held-out
samples through the trainer's eval cache; never writes.
"""

from __future__ import annotations

from typing import Any

import torch

from peagle_pipeline.core import loss, partition
from peagle_pipeline.core.copying import COPY_RIGHT, copy_classes
from peagle_pipeline.stages.train.packed_batch import read_packed
from peagle_pipeline.stages.train.packing import RowPlan, pack_rows

__all__ = ["eval_plans", "evaluate_held_out"]


def eval_plans(trainer: Any) -> list[RowPlan]:
    """The held-out samples packed for a full-depth evaluation. A full-depth layout holds up to K elements per
    token, so rows pack about tokens_per_step / (K // 2) tokens; a longer sample fills a row alone, cut where
    training cuts it (tokens_per_step), not at the row size: its last tokens, often the reply, are counted too.

    A run that splits its rows into sequence partitions to fit memory keeps the row size as the cut: the
    evaluation runs a row in one piece, and a whole tokens_per_step row at K elements per token may not fit.
    """
    K, tokens = trainer.cfg.depths, trainer.cfg.tokens_per_step
    budget = max(64, tokens // max(1, K // 2))
    longest = budget if trainer.cfg.sequence_partitions > 1 else max(budget, tokens)
    return pack_rows(trainer.eval_set.eval_ids, trainer.eval_set.eval_lengths, budget, longest=longest)


@torch.no_grad()
def evaluate_held_out(trainer: Any) -> dict[str, Any] | None:
    """`trainer`'s held-out loss, per-depth top-1 agreement and estimated acceptance length (full-depth chains);
    None without held-out samples. `trainer`: the run's `stages.train.trainer.Trainer` (its eval cache and split,
    draft, `prepare` and `forward_segment`; typed loosely, as the trainer imports this module)."""
    if len(trainer.eval_set.eval_ids) == 0:
        return None
    trainer.model.eval()
    K = trainer.cfg.depths
    plans = eval_plans(trainer)
    loss_sum, count, acc_sum, acc_n = 0.0, 0, 0.0, 0
    walk_accepted, walk_steps = 0, 0  # greedy decoding as vLLM walks it (`loss.acceptance_walk`)
    correct, total = torch.zeros(K, dtype=torch.long), torch.zeros(K, dtype=torch.long)
    # depth-0 elements whose next token the context spells out (core/copying.py), and those the draft got right
    copies, copies_right = 0, 0
    for i, plan in enumerate(plans):
        batch = read_packed(
            trainer.eval_cache, plan, -1, i, trainer.cfg.target == "exact", trainer.cfg.skip_corrupt
        )
        p = trainer.prepare(batch, full=True)
        if not p.segments:
            continue
        whole = partition.Segment(
            index=torch.arange(len(p.layout), device=trainer.dist.device),
            owned=torch.ones(len(p.layout), dtype=torch.bool, device=trainer.dist.device),
        )
        out = trainer.forward_segment(p, whole, trainer.model)
        loss_sum += float(out.loss_sum)
        count += int(out.count)
        correct += out.correct.cpu()
        total += out.total.cpu()
        s, n = loss.acceptance_estimate(p.layout, out.element_correct, out.element_valid, K)
        acc_sum, acc_n = acc_sum + float(s), acc_n + int(n)
        # replies are the weighted rows (`p.valid`); a row whose target has no draft-vocabulary token is a miss
        right = out.element_correct & out.element_valid
        accepted, steps = loss.acceptance_walk(p.layout, right, p.valid, K)
        walk_accepted, walk_steps = walk_accepted + accepted, walk_steps + steps
        rows = p.layout.rows  # depth-0 elements come first, one per packed row
        copy = out.element_valid[:rows].cpu() & (
            copy_classes(batch.input_ids, batch.doc_lengths) == COPY_RIGHT
        )
        copies += int(copy.sum())
        copies_right += int((out.element_correct[:rows].cpu() & copy).sum())
    trainer.model.train()
    return {
        "step": trainer.step,
        "kind": "eval",
        "loss": loss_sum / max(count, 1),
        "agreement": [c / t if t else None for c, t in zip(correct.tolist(), total.tolist(), strict=True)],
        "acceptance": acc_sum / acc_n if acc_n else None,
        # vLLM's walk over the same rows: on an eval cache of the target's greedy replies (`train --eval-cache`),
        # the acceptance length vLLM measures on those prompts at T = 0 (docs/guides/train.md)
        "acceptance_walk": 1 + walk_accepted / walk_steps if walk_steps else None,
        # the share of depth-0 positions whose next token the bigram copy rule gets right from the context,
        # and the draft's top-1 agreement there (docs/results/what-we-learned.md: drafts here miss most of them)
        "copy_share": copies / acc_n if acc_n else None,
        "copy_agreement": copies_right / copies if copies else None,
        "eval_elements": count,
        "eval_samples": len(trainer.eval_set.eval_ids),
    }
