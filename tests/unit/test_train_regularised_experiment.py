"""experiments/train_regularised.py's two patches: the feature noise acts in training only and within its bound, and
the frozen embedding table reaches AdamW with no gradient. (The screen itself: bench/results/regularise-cpu-2026-11-27.)"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

import train_regularised  # noqa: E402


def test_the_noise_is_bounded_by_the_rows_rms_and_only_in_training() -> None:
    fc = torch.nn.Linear(6, 3, bias=False)
    captured: list[torch.Tensor] = []
    fc.register_forward_pre_hook(train_regularised.noise_hook(0.1))
    fc.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))  # runs after the noise
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5, 0.0, 4.0], [10.0, 10.0, 10.0, 10.0, 10.0, 10.0]])
    fc.eval()
    fc(x)
    assert torch.equal(captured[-1], x)
    fc.train()
    fc(x)
    moved = captured[-1] - x  # [2, 6]
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    assert moved.abs().max() > 0
    assert bool((moved.abs() <= 0.1 * rms + 1e-6).all())


def test_patch_freezes_the_table_before_the_optimizer_sees_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen: dict[str, bool] = {}

    def fake_build(model: torch.nn.Module, **kw):  # type: ignore[no-untyped-def]
        seen["table_trainable"] = model.embed.weight.requires_grad
        seen["fc_trainable"] = model.fc.weight.requires_grad
        return None

    monkeypatch.setattr(train_regularised.trainer_module, "build_optimizer", fake_build)
    train_regularised.patch(0.0, True)
    model = torch.nn.Module()
    model.embed, model.fc = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4)
    train_regularised.trainer_module.build_optimizer(model, lr=1e-3, weight_decay=0.0)
    assert seen == {"table_trainable": False, "fc_trainable": True}
