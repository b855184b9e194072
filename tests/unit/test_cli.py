"""The CLI's error boundary: one line, an exit code, no traceback; flags reach the config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cli_run import run_cli

from peagle_pipeline import cli
from peagle_pipeline.config import ExtractConfig, GenerateConfig, TrainConfig


def test_usage_error_exit_2(capsys):
    assert cli.main(["extract", "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "No such option" in err and "Traceback" not in err


def test_config_error_is_one_line(capsys):
    assert cli.main(["train", "--cache", "c", "--output", "o", "--lr", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: lr must be positive, got -1.0"


def test_flags_become_overrides(monkeypatch):
    seen = {}

    def fake_run(cfg):
        seen["cfg"] = cfg

    import peagle_pipeline.stages.extract.stage as extract_stage
    import peagle_pipeline.stages.train.stage as train_stage

    monkeypatch.setattr(extract_stage, "run", fake_run)
    assert (
        cli.main(
            [
                "extract",
                "--model",
                "m",
                "--data",
                "a.jsonl",
                "--data",
                "b.jsonl",
                "--output",
                "o",
                "--layers",
                "1,3",
                "--topk",
                "5",
                "--last-hidden",
            ]
        )
        == 0
    )
    cfg = seen["cfg"]
    assert isinstance(cfg, ExtractConfig)
    assert (cfg.data, cfg.layers, cfg.topk, cfg.last_hidden) == (["a.jsonl", "b.jsonl"], [1, 3], 5, True)
    monkeypatch.setattr(train_stage, "run", fake_run)
    assert cli.main(["train", "--cache", "c", "--output", "o", "--depths", "4", "--no-export"]) == 0
    assert isinstance(seen["cfg"], TrainConfig) and seen["cfg"].depths == 4 and seen["cfg"].export is False


def test_generate_flags_become_overrides(monkeypatch, capsys):
    import peagle_pipeline.stages.generate.stage as generate_stage

    seen = {}

    def fake_run(cfg, echo=None):
        seen["cfg"] = cfg
        return generate_stage.GenerateSummary(output="o", rows_file="rows.jsonl", backend="hf")

    monkeypatch.setattr(generate_stage, "run", fake_run)
    argv = ["generate", "--model", "m", "--data", "d.jsonl", "--output", "o", "--turns", "last"]
    assert cli.main([*argv, "--samples-per-prompt", "3", "--temperature", "0.5"]) == 0
    cfg = seen["cfg"]
    assert isinstance(cfg, GenerateConfig)
    assert (cfg.turns, cfg.samples_per_prompt, cfg.temperature, cfg.data) == ("last", 3, 0.5, ["d.jsonl"])
    assert "generated rows.jsonl in o with hf" in capsys.readouterr().out


def test_every_config_field_has_a_flag():
    """One vocabulary for YAML and flags: each dataclass field is a CLI option of its command; the only other
    options are modes of the command, not settings (`extract --plan`: say the disk it needs and stop; `train
    --nproc-per-node N`: start N ranks of it), and train's `ctx` is typer's context, no option."""
    import dataclasses
    import inspect

    for command, cls, modes in (
        (cli.generate, GenerateConfig, set()),
        (cli.extract, ExtractConfig, {"plan"}),
        (cli.train, TrainConfig, {"nproc_per_node", "ctx"}),
    ):
        params = set(inspect.signature(command).parameters) - {"config"} - modes
        assert params == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("debug", ["0", "1"])
def test_debug_env_shows_traceback(tmp_path, debug):
    out = run_cli(["inspect", str(tmp_path / "nope")], env=dict(os.environ, PEAGLE_DEBUG=debug))
    assert out.code != 0
    assert ("Traceback" in out.stderr) == (debug == "1")


def _help(*args: str, capsys) -> str:
    assert cli.main([*args, "--help"]) == 0
    return capsys.readouterr().out


def test_help_shows_defaults_choices_and_brackets(capsys):
    out = " ".join(_help("train", capsys=capsys).split())  # unwrap the help columns
    assert "--schedule [cosine|linear|constant]" in out
    assert "--precision [auto|bf16|fp32]" in out and "--target [topk|exact]" in out
    assert "Learning-rate decay after warm-up. [default: cosine]" in out
    assert "[default: 0.0006]" in out and "[default: 8]" in out  # lr, depths
    assert "[default: --export]" in out and "[default: --no-resume]" in out
    assert "bounds [elements, Vd] memory" in out  # rich markup ate the brackets before
    assert "<bool>" not in out and "--help <" not in out
    assert "--cache <str> Cache directory" in out and "[required: flag or pipeline file]" in out
    extract = " ".join(_help("extract", capsys=capsys).split())
    assert "--backend [hf|vllm]" in extract and "--overlong [truncate|skip]" in extract


def test_help_names_positional_arguments_plainly(capsys):
    for command, name in (("inspect", "CACHE"), ("verify", "CACHE"), ("export", "RUN"), ("plot", "RUN")):
        out = _help(command, capsys=capsys)
        usage = out.splitlines()[0]
        assert usage.startswith(f"Usage: peagle-pipeline {command} [OPTIONS]") and usage.endswith(name), usage
        assert "{" not in usage


def test_version(capsys):
    from peagle_pipeline import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"peagle-pipeline {__version__}"


def test_ctrl_c_inside_a_command_is_exit_130_with_a_message(monkeypatch, capsys, tmp_path):
    """typer turns KeyboardInterrupt into a returned 130 under standalone_mode=False; main used to drop it (0)."""
    import peagle_pipeline.stages.train.metrics as metrics

    def interrupted(run_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(metrics, "plot", interrupted)
    assert cli.main(["plot", str(tmp_path)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: interrupted"), err


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["train", "--help"], ["plot", "{run}"]],
    ids=["help", "version", "train-help", "plot"],
)
def test_light_commands_do_not_import_torch(argv, tmp_path):
    """Start-up cost: torch (about 1.3 s warm, many seconds cold) is imported only by commands that need it."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "kind": "train", "loss": 2.0, "agreement": [0.5]}\n'
        '{"step": 1, "kind": "eval", "loss": 2.1, "agreement": [0.4], "acceptance": 1.2}\n'
    )
    args = [a.replace("{run}", str(tmp_path)) for a in argv]
    code = (
        "import sys; from peagle_pipeline import cli; rc = cli.main(sys.argv[1:]); "
        "print('RC', rc, 'torch' in sys.modules, 'rich' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "RC 0 False False", out.stdout + out.stderr


# ---- greedy sampling with several samples per prompt -----------------------------------------------------
def test_the_docs_greedy_example_with_two_samples_is_one_line_exit_2(capsys, tmp_path):
    """`--temperature 0 --samples-per-prompt 2` would write byte-identical duplicates: refused before anything."""
    out = tmp_path / "gen"
    argv = ["generate", "--model", "m", "--data", "d.jsonl", "--output", str(out)]
    assert cli.main([*argv, "--temperature", "0", "--samples-per-prompt", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: samples_per_prompt 2 with temperature 0")
    assert not out.exists()


def test_under_torchrun_rank_0_speaks_for_the_run(monkeypatch, capsys):
    """A failure every rank meets alike is said once, by rank 0, with the code torchrun replaces; another rank
    speaks only of its own failure, naming its rank."""
    from peagle_pipeline.cli import _report
    from peagle_pipeline.errors import CorruptCache, ResumeMismatch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "1")
    assert _report(ResumeMismatch("other settings")) == 5 and capsys.readouterr().err == ""
    assert _report(CorruptCache("sample 3 is damaged")) == 4
    assert capsys.readouterr().err == "error: rank 1: sample 3 is damaged\n"
    monkeypatch.setenv("RANK", "0")
    assert _report(ResumeMismatch("other settings")) == 5
    assert capsys.readouterr().err == (
        "error: other settings (exit 5; torchrun itself exits 1 and lists each rank's exit code)\n"
    )
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert (
        _report(ResumeMismatch("other settings")) == 5
        and capsys.readouterr().err == "error: other settings\n"
    )


def test_under_train_nproc_per_node_rank_0_leaves_a_lost_rank_to_the_launcher(monkeypatch, capsys):
    """The ranks `train --nproc-per-node N` starts: rank 0's line has no torchrun wording (the launcher exits with
    its code), a lost rank is the launcher's line, and the launcher prints nothing for a failure a rank reported."""
    from peagle_pipeline.cli import _report
    from peagle_pipeline.errors import RankLost, Reported, ResumeMismatch
    from peagle_pipeline.runtime import LAUNCHER_ENV

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv(LAUNCHER_ENV, "1")
    assert _report(ResumeMismatch("other settings")) == 5
    assert capsys.readouterr().err == "error: other settings\n"
    assert _report(RankLost("rank 1 of the 2 ranks died")) == 13 and capsys.readouterr().err == ""
    for name in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID", LAUNCHER_ENV):
        monkeypatch.delenv(name)
    assert _report(Reported(5)) == 5 and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("env", "argv", "line"),
    [
        ({}, ["--nproc-per-node", "0"], "error: --nproc-per-node must be at least 1, got 0"),
        (
            {"WORLD_SIZE": "2", "RANK": "0"},
            ["--nproc-per-node", "2"],
            "error: --nproc-per-node starts the ranks itself: run it as one process, not under torchrun",
        ),
    ],
)
def test_nproc_per_node_refusals_are_one_line(monkeypatch, capsys, env, argv, line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["train", "--cache", "c", "--output", "o", *argv]) == 2
    assert capsys.readouterr().err == line + "\n"
