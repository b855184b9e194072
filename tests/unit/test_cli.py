"""The CLI's error boundary: one line, an exit code, no traceback; flags reach the config."""

from __future__ import annotations

import subprocess
import sys

import pytest

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

    import peagle_pipeline.stages.extract as extract_stage
    import peagle_pipeline.stages.train as train_stage

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
    import peagle_pipeline.stages.generate as generate_stage

    seen = {}

    def fake_run(cfg, echo=None):
        seen["cfg"] = cfg
        return generate_stage.GenerateSummary(output="o", rows_file="rows.jsonl", backend="hf")

    monkeypatch.setattr(generate_stage, "run", fake_run)
    argv = ["generate", "--model", "m", "--data", "d.jsonl", "--output", "o", "--turns", "last"]
    assert cli.main([*argv, "--samples-per-prompt", "3", "--temperature", "0"]) == 0
    cfg = seen["cfg"]
    assert isinstance(cfg, GenerateConfig)
    assert (cfg.turns, cfg.samples_per_prompt, cfg.temperature, cfg.data) == ("last", 3, 0.0, ["d.jsonl"])
    assert "generated rows.jsonl in o with hf" in capsys.readouterr().out


def test_every_config_field_has_a_flag():
    """One vocabulary for YAML and flags: each dataclass field is a CLI option of its command."""
    import dataclasses
    import inspect

    for command, cls in (
        (cli.generate, GenerateConfig),
        (cli.extract, ExtractConfig),
        (cli.train, TrainConfig),
    ):
        params = set(inspect.signature(command).parameters) - {"config"}
        assert params == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("debug", ["0", "1"])
def test_debug_env_shows_traceback(tmp_path, debug, cli_env):
    cli_env["PEAGLE_DEBUG"] = debug
    out = subprocess.run(
        [sys.executable, "-m", "peagle_pipeline.cli", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=cli_env,
    )
    assert out.returncode != 0
    assert ("Traceback" in out.stderr) == (debug == "1")
