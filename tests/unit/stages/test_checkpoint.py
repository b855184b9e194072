"""Atomic checkpoints: completeness by rename, latest/best pointers, pruning, leftovers of killed writes."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.errors import BadInput
from peagle_pipeline.stages.checkpoint import CheckpointManager, step_dir_name


def save(m: CheckpointManager, step: int, best: bool = False):
    return m.save(
        step,
        {"w": torch.full((3,), float(step))},
        {"state": {}, "param_groups": []},
        {"step": step, "cursor": (0, step), "rng": torch.get_rng_state()},
        {"note": step},
        best=best,
    )


def test_roundtrip_and_pointers(tmp_path) -> None:
    m = CheckpointManager(tmp_path, keep=2)
    save(m, 1)
    save(m, 2, best=True)
    save(m, 3)
    ck = m.load_latest()
    assert ck.step == 3 and torch.equal(ck.model["w"], torch.full((3,), 3.0)) and ck.state["cursor"] == (0, 3)
    assert torch.equal(ck.state["rng"], torch.get_rng_state()) and ck.meta["note"] == 3
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == step_dir_name(3)
    assert m.best_step() == 2 and m.resolve("best").name == step_dir_name(2)
    assert m.resolve("step-3") == m.resolve("latest")


def test_prune_keeps_last_k_and_best(tmp_path) -> None:
    m = CheckpointManager(tmp_path, keep=2)
    save(m, 1, best=True)
    for s in range(2, 6):
        save(m, s)
    assert m.complete_steps() == [1, 4, 5]


def test_incomplete_write_is_ignored_and_cleaned(tmp_path) -> None:
    m = CheckpointManager(tmp_path, keep=3)
    save(m, 1)
    torn = tmp_path / "checkpoints" / (step_dir_name(2) + ".tmp")  # a write killed before its rename
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "checkpoints" / "latest").write_text(step_dir_name(2))  # even a lying pointer is not trusted
    assert (
        m.complete_steps() == [1]
        and m.load_latest().step == 1
        and m.resolve("latest").name == step_dir_name(1)
    )
    save(m, 2)
    assert not torn.exists() and m.load_latest().step == 2


def test_same_step_saved_twice_is_replaced(tmp_path) -> None:
    m = CheckpointManager(tmp_path, keep=2)
    save(m, 4)
    m.save(4, {"w": torch.zeros(3)}, {}, {}, {}, best=True)
    assert torch.equal(m.load_latest().model["w"], torch.zeros(3)) and m.best_step() == 4


def test_resolve_errors(tmp_path) -> None:
    m = CheckpointManager(tmp_path, keep=2)
    with pytest.raises(BadInput, match="no complete checkpoint"):
        m.resolve("latest")
    save(m, 1)
    assert m.resolve("best").name == step_dir_name(1)  # no best recorded: the latest
    with pytest.raises(BadInput, match="have: 1"):
        m.resolve("step-7")
