"""Training through the real CLI on real tiny caches: outputs, metrics, checkpoints, export, and every user
mistake ending in one error line with its exit code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from peagle_pipeline.cli import main
from peagle_pipeline.stages.checkpoint import CheckpointManager
from peagle_pipeline.stages.train import metrics

pytestmark = pytest.mark.slow

SMALL = [
    "--depths",
    "4",
    "--tokens-per-step",
    "256",
    "--steps",
    "6",
    "--eval-every",
    "3",
    "--save-every",
    "2",
    "--eval-samples",
    "6",
    "--precision",
    "fp32",
    "--log-every",
    "2",
    "--warmup",
    "1",
    "--lr",
    "2e-3",
    "--num-workers",
    "0",
    "--draft-vocab-size",
    "300",
    "--keep-checkpoints",
    "1",
]


def train(cache: Path, out: Path, *extra: str) -> int:
    return main(["train", "--cache", str(cache), "--output", str(out), *SMALL, *extra])


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tiny_cache: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    assert train(tiny_cache, out) == 0
    return out


def test_run_writes_everything(finished_run: Path, tiny_cache: Path) -> None:
    out = finished_run
    saved = yaml.safe_load((out / "train.yaml").read_text())["train"]
    assert saved["cache"] == str(tiny_cache) and saved["depths"] == 4 and saved["tokens_per_step"] == 256
    facts = json.loads((out / "run.json").read_text())
    assert facts["world_size"] == 1 and facts["starts"][0]["versions"]["torch"]

    records = metrics.read_metrics(out)
    train_recs = [r for r in records if r["kind"] == "train"]
    eval_recs = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train_recs] == [2, 4, 6]
    assert [r["step"] for r in eval_recs] == [3, 6]
    for r in train_recs:
        assert (
            r["loss"] > 0
            and len(r["agreement"]) == 4
            and 0.0 <= r["data_wait"] <= 1.0
            and r["tokens_per_s"] > 0
        )
    for r in eval_recs:
        assert r["acceptance"] >= 1.0 and len(r["agreement"]) == 4
    assert (out / "tb").is_dir() and any((out / "tb").iterdir())
    assert all(
        (out / "plots" / f"{n}.png").stat().st_size > 1000 for n in ("loss", "agreement", "acceptance")
    )

    # keep_checkpoints=1: only the last step plus the best one survive; `latest` names the last
    ckpt = CheckpointManager(out, keep=1)
    steps = ckpt.complete_steps()
    best = ckpt.best_step()
    assert steps[-1] == 6 and best in (3, 6) and set(steps) == {6, best}
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert (out / "export" / "config.json").is_file() and (out / "export" / "model.safetensors").is_file()


def test_output_with_a_run_is_not_overwritten(finished_run: Path, tiny_cache: Path, capsys) -> None:
    before = (finished_run / "metrics.jsonl").read_text()
    assert train(tiny_cache, finished_run) == 6
    assert "--resume" in one_error_line(capsys)
    assert (finished_run / "metrics.jsonl").read_text() == before


def test_foreign_non_empty_output_is_refused(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert train(tiny_cache, tmp_path) == 6
    assert "not empty" in one_error_line(capsys)


def test_resume_with_other_settings_is_refused(finished_run: Path, tiny_cache: Path, capsys) -> None:
    assert (
        main(
            [
                "train",
                "--cache",
                str(tiny_cache),
                "--output",
                str(finished_run),
                *SMALL,
                "--lr",
                "1e-3",
                "--seed",
                "3",
                "--resume",
            ]
        )
        == 5
    )
    line = one_error_line(capsys)
    assert "lr" in line and "seed" in line and "tokens_per_step" not in line


def test_resume_of_a_finished_run_does_nothing_more(finished_run: Path, tiny_cache: Path) -> None:
    weights = (finished_run / "checkpoints" / "step-00000006" / "model.safetensors").read_bytes()
    assert train(tiny_cache, finished_run, "--resume", "--log-every", "1") == 0  # log_every may change
    assert (finished_run / "checkpoints" / "step-00000006" / "model.safetensors").read_bytes() == weights


def test_resume_of_a_finished_run_keeps_the_users_files_in_its_export(
    finished_run: Path, tiny_cache: Path, capsys
) -> None:
    """`train --resume` on a finished run re-exports; it must not delete a README put there."""
    readme = finished_run / "export" / "README.md"
    readme.write_text("my notes\n")
    weights = (finished_run / "export" / "model.safetensors").read_bytes()
    try:
        assert train(tiny_cache, finished_run, "--resume") == 6
        line = one_error_line(capsys)
        assert "export holds files that are not part of a draft export (README.md)" in line
        assert "--no-export" in line
        assert readme.read_text() == "my notes\n"
        assert (finished_run / "export" / "model.safetensors").read_bytes() == weights
        assert train(tiny_cache, finished_run, "--resume", "--no-export") == 0
    finally:
        readme.unlink()
    assert train(tiny_cache, finished_run, "--resume") == 0  # only our files there: re-exported in place
    assert sorted(p.name for p in (finished_run / "export").iterdir()) == [
        ".peagle-export.json",
        "README.md",  # the model card again: the user's README (not a card) was never replaced
        "config.json",
        "model.safetensors",
    ]


def test_resume_without_a_run_is_refused(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    assert train(tiny_cache, tmp_path / "new", "--resume") == 2
    assert "nothing to resume" in one_error_line(capsys)


def test_missing_cache(tmp_path: Path, capsys) -> None:
    assert train(tmp_path / "no-such-cache", tmp_path / "run") == 3
    assert "not a peagle cache" in one_error_line(capsys)


def test_cache_of_another_format_version(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    meta = json.loads((cache / "cache.json").read_text())
    meta["format_version"] = 999
    (cache / "cache.json").write_text(json.dumps(meta))
    assert train(cache, tmp_path / "run") == 3
    assert "format 999" in one_error_line(capsys)


def test_incomplete_cache(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    manifest = next((cache / "stores").glob("*.zarr/manifest.json"))
    data = json.loads(manifest.read_text())
    data["complete"] = False
    manifest.write_text(json.dumps(data))
    assert train(cache, tmp_path / "run") == 3
    assert "incomplete" in one_error_line(capsys)


def test_draft_vocab_larger_than_target(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    assert train(tiny_cache, tmp_path / "run", "--draft-vocab-size", "1000") == 2
    assert "larger than the target vocabulary (512)" in one_error_line(capsys)


def test_exact_target_needs_last_hidden(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    assert train(tiny_cache, tmp_path / "run", "--target", "exact") == 2
    assert "--last-hidden" in one_error_line(capsys)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_exact_target_trains(tiny_cache_last_hidden: Path, tmp_path: Path, method: str) -> None:
    out = tmp_path / "run"
    argv = ["--target", "exact", "--method", method, "--steps", "3", "--no-export"]
    assert train(tiny_cache_last_hidden, out, *argv) == 0
    recs = metrics.read_metrics(out)
    assert recs[-1]["kind"] == "eval" and recs[-1]["loss"] > 0 and recs[-1]["acceptance"] >= 1.0
    assert not (out / "export").exists()


def _drop_shard(cache: Path) -> None:
    shard = next(p for p in (cache / "stores").glob("*.zarr/aux_hidden/c/1"))
    shutil.rmtree(shard)


def test_corrupt_sample_stops_training(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    _drop_shard(cache)
    assert train(cache, tmp_path / "run", "--no-export") == 4
    line = one_error_line(capsys)
    assert "missing" in line and "--skip-corrupt" in line


def test_corrupt_samples_are_skipped_and_reported(tiny_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    _drop_shard(cache)
    out = tmp_path / "run"
    assert train(cache, out, "--skip-corrupt", "--no-export", "--eval-samples", "0") == 0
    recs = [r for r in metrics.read_metrics(out) if r["kind"] == "train"]
    assert recs[-1]["skipped_corrupt"] > 0


def test_a_run_shorter_than_the_default_warmup_still_reaches_the_peak_lr(
    tiny_cache: Path, tmp_path: Path, capsys
) -> None:
    """--steps 6 with the default --warmup (50): the warm-up is cut to a tenth of the run (1 step), with a note."""
    i = SMALL.index("--warmup")
    argv = [*SMALL[:i], *SMALL[i + 2 :], "--log-every", "1", "--no-export", "--eval-samples", "0"]
    out = tmp_path / "run"
    assert main(["train", "--cache", str(tiny_cache), "--output", str(out), *argv]) == 0
    assert "warmup 50 is not below the run's 6 steps" in capsys.readouterr().err
    lrs = [r["lr"] for r in metrics.read_metrics(out) if r["kind"] == "train"]
    assert len(lrs) == 6 and lrs[0] == pytest.approx(2e-3) and lrs[-1] < lrs[0]


def test_start_prints_draft_vocabulary_coverage(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    """Docs/guides/recipes.md: the coverage of the draft vocabulary is printed at the start of training."""
    import numpy as np

    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.core.vocab import build_draft_vocab

    flags = ["--steps", "1", "--eval-samples", "0", "--no-export", "--draft-vocab-size", "50"]
    assert train(tiny_cache, tmp_path / "run", *flags) == 0
    counts = open_cache(tiny_cache).token_counts()
    ids = build_draft_vocab(counts, 50).ids.numpy()
    share = counts[ids].sum() / counts.sum()
    assert 0.0 < share < 1.0  # 50 of the cache's supervised token ids: a real partial coverage
    lines = [line for line in capsys.readouterr().err.splitlines() if "draft vocabulary" in line]
    assert lines == [
        f"draft vocabulary: 50 of 512 target tokens, covering {share:.1%} of the "
        f"{int(np.sum(counts))} supervised tokens in the cache"
    ]


def test_a_training_run_never_imports_transformers(tiny_cache: Path, tmp_path: Path) -> None:
    """Training reads what it needs of the tokenizer from the cache (target/tokenizer_facts.json): a whole run,
    export included, never imports transformers, whose import costs ~5 s of every start on 2 cores."""
    import subprocess
    import sys

    argv = ["train", "--cache", str(tiny_cache), "--output", str(tmp_path / "run"), *SMALL, "--steps", "2"]
    code = (
        "import sys\nfrom peagle_pipeline.cli import main\n"
        f"rc = main({argv!r})\nprint(rc, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["0", "False"], out.stderr[-2000:]
    assert (tmp_path / "run" / "export" / "config.json").is_file()


def _eval_records(out: Path) -> list[dict]:
    return [r for r in metrics.read_metrics(out) if r["kind"] == "eval"]


def test_eval_cache_gives_the_held_out_set(
    tiny_cache: Path, other_tiny_cache: Path, foreign_tiny_cache: Path, tmp_path: Path, capsys
) -> None:
    """train.eval_cache: the held-out figures come from that cache's own held-out split (what a run trained on it
    holds out), whatever the training data; a cache of another target is refused in one line."""
    short = ["--steps", "2", "--eval-every", "2", "--no-export"]
    assert train(tiny_cache, tmp_path / "own", *short) == 0
    assert train(tiny_cache, tmp_path / "other", *short, "--eval-cache", str(other_tiny_cache)) == 0
    assert train(other_tiny_cache, tmp_path / "ref", *short) == 0
    own, other, ref = (_eval_records(tmp_path / n)[-1] for n in ("own", "other", "ref"))
    assert other["eval_elements"] == ref["eval_elements"] != own["eval_elements"]
    assert other["eval_samples"] == ref["eval_samples"] == 6
    assert other["loss"] != ref["loss"]  # another draft (trained on other data) on the same held-out set
    saved = yaml.safe_load((tmp_path / "other" / "train.yaml").read_text())["train"]
    assert saved["eval_cache"] == str(other_tiny_cache)
    # nothing of the training cache is held out then: one epoch over it has more samples, so more steps
    epoch = ["--cache", str(tiny_cache), *SMALL, "--epochs", "1", "--eval-every", "100", "--no-export"]
    epoch_steps = {}
    for name, extra in (("own-epoch", []), ("other-epoch", ["--eval-cache", str(other_tiny_cache)])):
        argv = list(epoch)
        i = argv.index("--steps")
        del argv[i : i + 2]  # epochs decide the length
        assert main(["train", *argv, "--output", str(tmp_path / name), *extra]) == 0
        facts = json.loads((tmp_path / name / "run.json").read_text())
        epoch_steps[name] = facts["starts"][-1]["total_steps"]
    assert epoch_steps["other-epoch"] > epoch_steps["own-epoch"]

    capsys.readouterr()
    assert train(tiny_cache, tmp_path / "bad", *short, "--eval-cache", str(foreign_tiny_cache)) == 3
    line = one_error_line(capsys)
    assert "eval_cache" in line and "another target" in line and "aux_layer_ids" in line


def test_extra_cache_trains_beside_the_cache_with_its_held_out_set(
    tiny_cache: Path,
    other_tiny_cache: Path,
    foreign_tiny_cache: Path,
    tiny_cache_last_hidden: Path,
    tmp_path: Path,
    capsys,
) -> None:
    """train.extra_cache: every usable sample of an extra cache trains beside the cache's training split, read from
    its own cache; the held-out set stays the cache's own, so the held-out figures compare with a run on the cache
    alone. Another target, arrays that do not stack, or the same cache twice are refused in one line."""
    import dataclasses

    import torch

    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.config import TrainConfig
    from peagle_pipeline.stages.train.train_data import training_data

    cfg = TrainConfig(
        cache=str(tiny_cache), extra_cache=[str(other_tiny_cache)], output=str(tmp_path / "x"), eval_samples=6
    )
    union, split = training_data(cfg)
    alone, alone_split = training_data(dataclasses.replace(cfg, extra_cache=[]))
    other = open_cache(other_tiny_cache)
    start = int(union.starts[1])
    assert start > int(alone.samples["sample_id"].max())  # the ranges do not overlap
    assert split.eval_ids.tolist() == alone_split.eval_ids.tolist() and len(split.eval_ids) == 6
    assert split.train_ids[split.train_ids < start].tolist() == alone_split.train_ids.tolist()
    usable = other.samples[(other.samples["num_supervised"] > 0) & (other.samples["length"] > 1)]
    extra_ids = split.train_ids[split.train_ids >= start] - start
    assert sorted(extra_ids.tolist()) == sorted(usable["sample_id"].tolist()) and len(extra_ids) > 0
    sid = int(extra_ids[-1])
    got, want = union.read_sample(start + sid), other.read_sample(sid)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.aux_hidden, want.aux_hidden)
    assert (union.token_counts() == alone.token_counts() + other.token_counts()).all()
    some = np.array([0, 3, start + sid, 1])
    assert union.prompt_keys(some) == [
        *alone.prompt_keys(some[:2]),
        *other.prompt_keys([sid]),
        alone.prompt_keys([1])[0],
    ]

    short = ["--steps", "2", "--eval-every", "2", "--no-export"]
    assert train(tiny_cache, tmp_path / "alone", *short) == 0
    capsys.readouterr()
    assert train(tiny_cache, tmp_path / "both", *short, "--extra-cache", str(other_tiny_cache)) == 0
    err = capsys.readouterr().err
    assert (
        f"training on {len(alone_split.train_ids)} samples of cache {tiny_cache} and {len(extra_ids)} of 1 extra "
        "cache(s)" in err
    ), err
    both, ref = _eval_records(tmp_path / "both")[-1], _eval_records(tmp_path / "alone")[-1]
    assert both["eval_elements"] == ref["eval_elements"] and both["eval_samples"] == ref["eval_samples"] == 6
    saved = yaml.safe_load((tmp_path / "both" / "train.yaml").read_text())["train"]
    assert saved["extra_cache"] == [str(other_tiny_cache)]
    # a resume without the extra cache would train on other data: refused
    assert train(tiny_cache, tmp_path / "both", *short, "--resume", "--steps", "3") == 5
    assert "extra_cache" in one_error_line(capsys)

    refusals = [
        (foreign_tiny_cache, 3, ["extra_cache", "cannot train beside cache", "aux_layer_ids"]),
        (tiny_cache_last_hidden, 3, ["extra_cache", "has_last_hidden"]),
        (tiny_cache, 2, ["cache and extra_cache name the same cache twice"]),
    ]
    for i, (extra, code, parts) in enumerate(refusals):
        assert train(tiny_cache, tmp_path / f"bad{i}", *short, "--extra-cache", str(extra)) == code
        line = one_error_line(capsys)
        assert all(part in line for part in parts), line
        assert not (tmp_path / f"bad{i}").exists()


def test_training_leaves_out_the_prompts_of_held_out_samples(
    tiny_cache: Path, tiny_cache_last_hidden: Path, other_tiny_cache: Path, tmp_path: Path, capsys
) -> None:
    """A training sample whose prompt is a held-out sample's (here: the same conversations in the eval cache; also
    several replies to one prompt, or an extra cache of the same prompts) is left out of training and counted, so
    the held-out figures stay unseen. Training on other conversations loses nothing."""
    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.config import TrainConfig
    from peagle_pipeline.core.heldout import split_samples
    from peagle_pipeline.stages.train.train_data import held_out_set, training_data, without_held_out_prompts

    cfg = TrainConfig(
        cache=str(tiny_cache_last_hidden),
        eval_cache=str(tiny_cache),
        output=str(tmp_path / "x"),
        eval_samples=6,
    )
    cache, split = training_data(cfg)
    eval_cache, eval_set = held_out_set(cache, split, cfg)
    kept = without_held_out_prompts(cache, split, eval_cache, eval_set)
    held = set(eval_cache.prompt_keys(eval_set.eval_ids))
    assert len(eval_set.eval_ids) == 6 and set(eval_set.eval_ids) <= set(split.train_ids)  # one data file
    assert not set(eval_set.eval_ids) & set(kept.train_ids)
    assert kept.shared_prompts == len(split.train_ids) - len(kept.train_ids) >= 6
    assert not held & set(cache.prompt_keys(kept.train_ids))
    lengths = dict(zip(split.train_ids.tolist(), split.train_lengths.tolist(), strict=True))
    assert kept.train_lengths.tolist() == [lengths[i] for i in kept.train_ids.tolist()]
    other = open_cache(other_tiny_cache)
    other_split = split_samples(other.samples, 0, cfg.seed)
    assert without_held_out_prompts(other, other_split, eval_cache, eval_set) is other_split

    short = ["--steps", "2", "--eval-every", "2", "--no-export", "--eval-samples", "6"]
    assert train(tiny_cache_last_hidden, tmp_path / "run", *short, "--eval-cache", str(tiny_cache)) == 0
    err = capsys.readouterr().err
    assert f"left {kept.shared_prompts} sample(s) out of training" in err, err
    assert _eval_records(tmp_path / "run")[-1]["eval_samples"] == 6


def test_loss_on_all_positions(tiny_cache: Path, tmp_path: Path) -> None:
    """train.loss_positions all: every position carries loss (more COD elements per step than the replies alone);
    the held-out figures still use the loss mask, so both runs report the same held-out elements."""
    short = ["--steps", "2", "--eval-every", "2", "--log-every", "1", "--no-export"]
    assert train(tiny_cache, tmp_path / "mask", *short) == 0
    assert train(tiny_cache, tmp_path / "all", *short, "--loss-positions", "all") == 0
    steps = {
        n: [r for r in metrics.read_metrics(tmp_path / n) if r["kind"] == "train"] for n in ("mask", "all")
    }
    assert all(a["elements"] > m["elements"] for a, m in zip(steps["all"], steps["mask"], strict=True))
    assert (
        _eval_records(tmp_path / "all")[-1]["eval_elements"]
        == _eval_records(tmp_path / "mask")[-1]["eval_elements"]
    )


def test_run_from_before_a_new_setting_resumes(finished_run: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """A run whose train.yaml predates a setting (here loss_positions, eval_cache, extra_cache) resumes: it had the
    default."""
    run = tmp_path / "old"
    shutil.copytree(finished_run, run)
    path = run / "train.yaml"
    saved = yaml.safe_load(path.read_text())
    del saved["train"]["loss_positions"], saved["train"]["eval_cache"], saved["train"]["extra_cache"]
    saved["train"]["output"] = str(run)
    path.write_text(yaml.safe_dump(saved))
    assert train(tiny_cache, run, "--resume", "--steps", "7", "--no-export") == 0
    assert [r["step"] for r in metrics.read_metrics(run) if r["kind"] == "eval"][-1] == 7
    # refused: the run trained with the default, "assistant"
    assert train(tiny_cache, run, "--resume", "--steps", "8", "--loss-positions", "all") == 5


def test_exact_target_needs_last_hidden_in_the_eval_cache_too(
    tiny_cache_last_hidden: Path, tiny_cache: Path, tmp_path: Path, capsys
) -> None:
    flags = ["--target", "exact", "--eval-cache", str(tiny_cache), "--no-export"]
    assert train(tiny_cache_last_hidden, tmp_path / "run", *flags) == 2
    line = one_error_line(capsys)
    assert "eval_cache" in line and "last hidden" in line
