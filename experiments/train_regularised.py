"""`peagle-pipeline train` with one of two regularisers the package does not have, for a screen at full budget.

At `make quality`'s main budget (1,740 steps over ~600k distinct tokens, about 3 passes) the draft's depth-0
agreement on its training rows reaches 0.60 in the third pass while the held-out one stays at 0.38: it memorises.
This wrapper asks whether the classic remedies close that gap, by patching the trainer's optimizer construction
(nothing else):

- `--feature-noise A`: EAGLE's feature noise. While training, `fc`'s input (the concatenated aux states, or the
  mask state) gets U(-A, A) x the row's RMS added.
- `--freeze-embedding`: the embedding table keeps the target's weights (`train` trains it; this is the screen).

Everything after `--` is `peagle-pipeline train`'s own arguments, e.g.

    .venv/bin/python experiments/train_regularised.py --feature-noise 0.1 -- train -c run.yaml

Results: docs/results/what-we-learned.md (section "The levers, measured in vLLM").
"""

from __future__ import annotations

import argparse
import sys

import torch

import peagle_pipeline.stages.train.trainer as trainer_module
from peagle_pipeline.cli import main as cli_main


def noise_hook(amplitude: float):  # type: ignore[no-untyped-def]
    """A forward pre-hook adding U(-a, a) x RMS(row) to a module's input [N, D] in training mode only."""

    def pre(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if not module.training:
            return None
        (x,) = args
        rms = x.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)  # [N, 1]
        return (x + (torch.rand_like(x) * 2 - 1) * amplitude * rms,)

    return pre


def patch(feature_noise: float, freeze_embedding: bool) -> None:
    """Wrap the trainer's `build_optimizer`: it sees the draft before any parameter is handed to AdamW."""
    build = trainer_module.build_optimizer

    def patched(model: torch.nn.Module, **kw):  # type: ignore[no-untyped-def]
        if freeze_embedding:
            for m in model.modules():
                if isinstance(m, torch.nn.Embedding):
                    m.weight.requires_grad_(False)
        if feature_noise > 0:
            model.fc.register_forward_pre_hook(noise_hook(feature_noise))
        print(
            f"regularised: feature noise {feature_noise}, embedding frozen {freeze_embedding}",
            file=sys.stderr,
        )
        return build(model, **kw)

    trainer_module.build_optimizer = patched


if __name__ == "__main__":
    argv = sys.argv[1:]
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--feature-noise", type=float, default=0.0, help="A of U(-A, A) x RMS (0: off)")
    ap.add_argument("--freeze-embedding", action="store_true", help="keep the embedding table fixed")
    args = ap.parse_args(ours)
    if not theirs or theirs[0] != "train":
        ap.error("give `-- train ...` (peagle-pipeline train's arguments) after the wrapper's own")
    patch(args.feature_noise, args.freeze_embedding)
    sys.exit(cli_main(theirs))
