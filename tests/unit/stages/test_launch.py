"""What `train --nproc-per-node N` runs and how it ends (stages/train/launch.py): each rank's command line, and the
run's exit code and line from its ranks' exit codes (real processes: tests/integration/test_train_launch.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from peagle_pipeline.errors import Interrupted, RankLost, Reported
from peagle_pipeline.stages.train.launch import outcome, rank_command, rank_env

KILL = -signal.SIGKILL
INT = -signal.SIGINT


@pytest.mark.parametrize(
    "given",
    [
        ["train", "--nproc-per-node", "4", "--cache", "c", "--output", "o"],
        ["train", "--cache", "c", "--nproc-per-node=4", "--output", "o"],
        ["train", "--cache", "c", "--output", "o", "--nproc-per-node", "4"],
    ],
)
def test_each_rank_runs_the_command_line_less_the_flag(given: list[str]) -> None:
    assert rank_command(given) == ["train", "--cache", "c", "--output", "o"]


def test_each_rank_has_torchrun_s_variables() -> None:
    env = rank_env({"WORLD_SIZE": "2"}, 1)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "1", "2")


def _ended(codes: list[int], order: list[int], stop: int = 0, out: Path = Path("run"), **kw) -> object:
    return outcome(codes, order, stop, str(out), **kw)


def test_every_rank_done_is_success() -> None:
    assert _ended([0, 0], [1, 0]) is None


@pytest.mark.parametrize(
    ("codes", "order", "stop", "code"),
    [
        ([5, 5], [1, 0], 0, 5),  # a refusal every rank meets: rank 0 said it
        ([7, 13], [0, 1], 0, 7),  # rank 0's own failure (the run is locked), rank 1 lost it
        ([1, 13], [0, 1], 0, 1),  # rank 0's traceback
        ([130, 130], [1, 0], signal.SIGINT, 130),  # a Ctrl-C every rank obeyed
        ([143, 143], [0, 1], signal.SIGTERM, 143),
        ([INT, 130], [1, 0], signal.SIGINT, 130),  # killed by the very signal passed on: stopped
        ([130, KILL], [0, 1], signal.SIGINT, 130),  # rank 0 said it; rank 1 was killed after it
    ],
)
def test_rank_0_s_own_code_is_the_run_s(codes: list[int], order: list[int], stop: int, code: int) -> None:
    err = _ended(codes, order, stop)
    assert isinstance(err, Reported) and err.exit_code == code


def test_a_rank_killed_is_named_with_the_resume_command(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step-00000006").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000006" / "meta.json").write_text("{}")
    err = _ended([13, KILL], [1, 0], out=tmp_path)
    assert isinstance(err, RankLost) and err.exit_code == 13
    assert str(err) == (
        f"rank 1 of the 2 ranks of {tmp_path} was killed by SIGKILL: the last complete checkpoint is step 6; "
        "re-run the same command with --resume to continue"
    )


def test_a_rank_that_failed_on_its_own_is_named_before_those_stopped_after_it(tmp_path: Path) -> None:
    err = _ended([143, 4, 13], [1, 2, 0], out=tmp_path, forced={0})  # rank 0 was SIGTERMed by the launcher
    assert isinstance(err, RankLost) and str(err).startswith(
        f"rank 1 of the 3 ranks of {tmp_path} ended with exit code 4: nothing was saved yet; re-run the same "
        "command to start"
    )


def test_a_stop_that_a_rank_did_not_obey_says_which(tmp_path: Path) -> None:
    (tmp_path / "train.yaml").write_text("train: {}\n")
    err = _ended([KILL, 130], [1, 0], signal.SIGINT, tmp_path, forced={0})
    assert isinstance(err, Interrupted) and err.exit_code == 130
    assert str(err) == (
        f"interrupted: rank 0 of the 2 ranks of {tmp_path} was still running 30 s after another rank ended, and "
        "was killed: no checkpoint was saved yet; re-run the same command with --resume to continue from the start"
    )
