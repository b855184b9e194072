"""Starting and resuming training runs the way users do: a failed start never blocks the retry, a
resume compares what paths point to (and the cache's identity) rather than their spelling, settings that do not
change the result may change, a run can be extended (the schedule rule is stated), progress is printed without a
terminal, and what the run quietly adjusted (eval split, truncation) is reported.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_argv import small_train_flags
from cli_run import peagle

from peagle_pipeline.cli import main
from peagle_pipeline.hardware import usable_cpus
from peagle_pipeline.stages.train import metrics
from peagle_pipeline.stages.train.optim import lr_at

pytestmark = pytest.mark.slow

STEPS = 4
FLAGS = small_train_flags(
    depths=2, tokens_per_step=256, steps=STEPS, eval_every=2, save_every=2, num_workers=0, eval_samples=4
)


def train(cache: Path | str, out: Path | str, *extra: str) -> int:
    return main(["train", "--cache", str(cache), "--output", str(out), *FLAGS, *extra])


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0]


def ckpt_steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*") if not p.suffix)


@pytest.fixture(scope="module")
def finished(tiny_cache: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(tiny_cache, out) == 0
    return out


@pytest.fixture
def run_copy(finished: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished, dst)
    return dst


# ----------------------------------------------------------------------------------------- failed starts
def test_failed_start_leaves_nothing_and_the_retry_runs(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert train(tiny_cache, out, "--target", "exact") == 2  # the cache has no last hidden states
    assert "--last-hidden" in error_line(capsys)
    assert not out.exists()  # no train.yaml, run.json or train.lock to block the retry
    assert train(tiny_cache, out, "--resume") == 2  # nothing started, so nothing to resume
    assert "nothing to resume" in error_line(capsys)
    premade = tmp_path / "premade"
    premade.mkdir()
    assert train(tiny_cache, premade, "--draft-vocab-size", "100000") == 2
    assert list(premade.iterdir()) == []  # a folder the user made stays, empty
    assert train(tiny_cache, out) == 0 and ckpt_steps(out)[-1] == STEPS


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_leftovers_of_a_run_that_never_trained_do_not_block(
    finished: Path, tiny_cache: Path, tmp_path: Path, resume: bool
) -> None:
    """What a failed start of an earlier version left (train.yaml with other settings, run.json, the lock)."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("train.yaml", "run.json", "draft.json", "train.lock"):
        shutil.copy(finished / name, out / name)
    (out / "train.yaml").write_text((out / "train.yaml").read_text().replace("lr: 0.002", "lr: 0.5"))
    assert train(tiny_cache, out, *(["--resume"] if resume else [])) == 0
    assert ckpt_steps(out)[-1] == STEPS and "lr: 0.002" in (out / "train.yaml").read_text()


# -------------------------------------------------------------------------------- paths and identity
def test_resume_compares_real_paths_not_spellings(
    run_copy: Path, tiny_cache: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tiny_cache.parent)
    for spelling in (
        f"./{tiny_cache.name}/",
        f"{tiny_cache}/",
        f"../{tiny_cache.parent.name}/{tiny_cache.name}",
    ):
        assert train(spelling, run_copy, "--resume") == 0, spelling
    moved = tmp_path / "elsewhere" / "moved-run"
    moved.parent.mkdir()
    shutil.move(run_copy, moved)  # train.yaml still names the old output
    monkeypatch.chdir(tmp_path)
    assert train(os.path.relpath(tiny_cache), "elsewhere/moved-run", "--resume") == 0
    assert ckpt_steps(moved)[-1] == STEPS


def test_resume_follows_a_moved_cache_and_refuses_another(
    run_copy: Path, tiny_cache: Path, tmp_path: Path, capsys
) -> None:
    moved = tmp_path / "moved-cache"
    shutil.copytree(tiny_cache, moved)
    assert train(moved, run_copy, "--resume", "--steps", "5") == 0  # same cache.json: the same cache
    assert ckpt_steps(run_copy)[-1] == 5
    meta = json.loads((moved / "cache.json").read_text())
    meta["dataset_fingerprint"] = "0123456789abcdef"  # re-extracted in place from other data
    (moved / "cache.json").write_text(json.dumps(meta))
    assert train(moved, run_copy, "--resume", "--steps", "6") == 5
    assert "is another cache" in error_line(capsys)


# --------------------------------------------------------------------- harmless changes, extending
def test_resume_allows_changes_that_keep_the_result(run_copy: Path, tiny_cache: Path, capsys) -> None:
    argv = ["--device", "cpu", "--keep-checkpoints", "3", "--save-every", "1", "--eval-every", "1"]
    argv += ["--report-to", "none"]  # where the metrics go is not the weights either
    assert train(tiny_cache, run_copy, "--resume", *argv) == 0
    assert train(tiny_cache, run_copy, "--resume", "--lr", "1e-3") == 5  # this one changes the result
    assert "lr (0.002 -> 0.001)" in error_line(capsys)
    assert train(tiny_cache, run_copy, "--resume", "--grad-accum", "2") == 5  # so does the global batch
    assert error_line(capsys).endswith("settings differ from its train.yaml: grad_accum (1 -> 2)")


def test_resume_extends_the_run_and_recomputes_the_schedule(run_copy: Path, tiny_cache: Path, capsys) -> None:
    assert train(tiny_cache, run_copy, "--resume", "--steps", "7") == 0
    err = capsys.readouterr().err
    assert f"resumed {run_copy} at step {STEPS} of 7" in err
    assert f"schedule is recomputed for 7 steps from step {STEPS}" in err
    recs = [r for r in metrics.read_metrics(run_copy) if r["kind"] == "train"]
    assert [r["step"] for r in recs] == list(range(1, 8))
    for r in recs[STEPS:]:  # warm-up 2 and peak 2e-3 from FLAGS; the cosine now ends at step 7
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, 2e-3, 2, 7, "cosine"))
    assert ckpt_steps(run_copy)[-1] == 7
    facts = json.loads((run_copy / "run.json").read_text())
    assert [s["total_steps"] for s in facts["starts"]] == [STEPS, 7]
    assert facts["global_batch_tokens"] == 256  # tokens_per_step x 1 rank x grad_accum 1
    assert (
        "global batch: 256 tokens per optimizer step (tokens_per_step 256 x 1 rank(s) x grad_accum 1)" in err
    )
    assert train(tiny_cache, run_copy, "--resume", "--steps", "5") == 5
    assert "it is at step 7" in error_line(capsys)


# ------------------------------------------------------------------- what the user is told
def test_progress_lines_and_resume_notice_without_a_terminal(tiny_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = peagle("train", "--cache", str(tiny_cache), "--output", str(out), *FLAGS)  # stderr is a pipe
    assert f"step {STEPS}/{STEPS} (100%): loss " in first.stderr and "eta 0:00:00" in first.stderr
    assert f"eval at step {STEPS}: loss " in first.stderr
    again = peagle(
        "train", "--cache", str(tiny_cache), "--output", str(out), *FLAGS, "--resume", "--steps", "5"
    )
    assert f"resumed {out} at step {STEPS} of 5" in again.stderr and "step 5/5 (100%)" in again.stderr


def test_capped_eval_split_is_reported(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert train(tiny_cache, out, "--eval-samples", "1000") == 0
    assert "eval_samples 1000 capped at 20: at most half of the 40 usable samples" in capsys.readouterr().err
    evals = [r for r in metrics.read_metrics(out) if r["kind"] == "eval"]
    assert evals and all(r["eval_samples"] == 20 for r in evals)


def test_more_workers_than_cpus_is_said_once(tiny_cache: Path, tmp_path: Path) -> None:
    """num_workers above the CPUs the process may use: one line of ours, and not torch's UserWarning (printed twice,
    each with its source line)."""
    workers = usable_cpus() + 1
    flags = small_train_flags(
        depths=2, tokens_per_step=256, steps=2, eval_every=2, num_workers=workers, eval_samples=4
    )
    done = peagle("train", "--cache", str(tiny_cache), "--output", str(tmp_path / "run"), *flags)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(f"num_workers {workers} is more than the {usable_cpus()} CPUs") == 1, done.stderr
    assert "This DataLoader will create" not in done.stderr and "UserWarning" not in done.stderr, done.stderr
    assert "step 2/2 (100%)" in done.stderr


def test_truncating_budget_is_reported(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    assert train(tiny_cache, tmp_path / "run", "--tokens-per-step", "200", "--steps", "1") == 0
    err = capsys.readouterr().err
    assert "tokens_per_step 200 is shorter than" in err and "use --tokens-per-step 255 or more" in err
