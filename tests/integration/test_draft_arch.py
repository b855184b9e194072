"""`train --draft-arch`: the style of the draft's decoder layers, apart from the target's family.

A Qwen3-style layer (QK-norm) on the tiny Llama target trains, exports as a Qwen3 `transformer_layer_config` with
its q_norm/k_norm weights, and reloads as such; a resume refuses a changed style; the choice for each target
family follows `auto`. (vLLM loads such an export with greedy output unchanged: tests/vllm/test_vllm_check.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_argv import small_train_flags

from peagle_pipeline.cli import main

pytestmark = pytest.mark.slow

FLAGS = small_train_flags(
    depths=2, tokens_per_step=256, steps=2, eval_every=2, save_every=2, num_workers=0, eval_samples=4
)


@pytest.fixture(scope="module")
def qwen3_style_run(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("arch") / "run"
    assert (
        main(
            [
                "train",
                "--cache",
                str(tiny_cache),
                "--output",
                str(run),
                *FLAGS,
                "--export",
                "--draft-arch",
                "qwen3",
            ]
        )
        == 0
    )
    return run


def test_a_qwen3_style_layer_on_a_llama_target_exports_and_reloads(qwen3_style_run: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from peagle_pipeline.stages.draft_spec import DraftSpec
    from peagle_pipeline.stages.export.speculators_format import load_export

    assert DraftSpec.load(qwen3_style_run).qk_norm
    export = qwen3_style_run / "export"
    layer = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["architectures"] == ["Qwen3ForCausalLM"]
    weights = load_file(str(export / "model.safetensors"))
    D = layer["head_dim"]
    assert weights["layers.0.self_attn.q_norm.weight"].shape == (D,)
    assert weights["layers.0.self_attn.k_norm.weight"].shape == (D,)
    assert load_export(export, torch.float32).cfg.qk_norm


def test_the_terminal_says_which_style_and_where_the_norms_start(
    tiny_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO"):
        code = main(["train", "--cache", str(tiny_cache), "--output", str(tmp_path / "r"), *FLAGS, "--steps", "1"]
                    + ["--draft-arch", "qwen3"])  # fmt: skip
    assert code == 0
    assert (
        "draft layers: Qwen3 architecture (q_norm/k_norm, --draft-arch qwen3; the target has none)"
        in caplog.text
    )
    assert "the draft's q_norm/k_norm at 1 (the target has none)" in caplog.text
    assert "written before they were stored" not in caplog.text  # not a Qwen3 cache missing its norms


def test_resume_refuses_another_draft_arch(
    qwen3_style_run: Path, tiny_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for other in ("llama", "auto"):
        argv = ["train", "--cache", str(tiny_cache), "--output", str(qwen3_style_run), *FLAGS, "--resume"]
        assert main([*argv, "--draft-arch", other]) == 5
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert len(err) == 1 and f"draft_arch ('qwen3' -> '{other}')" in err[0], err


def test_an_unknown_draft_arch_is_one_line(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    code = main(
        ["train", "--cache", str(tiny_cache), "--output", str(tmp_path / "r"), "--draft-arch", "gemma"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "draft_arch must be one of auto, llama, qwen3" in err[0], err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("model_type", "arch", "qk_norm"),
    [
        ("llama", "auto", False),
        ("llama", "qwen3", True),
        ("qwen3", "auto", True),
        ("qwen3", "llama", False),
        ("qwen3_moe", "auto", True),
        ("mistral", "llama", False),
    ],
)
def test_auto_is_the_targets_family(tmp_path: Path, model_type: str, arch: str, qk_norm: bool) -> None:
    from peagle_pipeline.config import TrainConfig
    from peagle_pipeline.stages.train.draft import draft_qk_norm

    cfg = TrainConfig(cache="c", output=str(tmp_path / "new"), draft_arch=arch)  # type: ignore[arg-type]
    assert draft_qk_norm(cfg, {"model_type": model_type}) is qk_norm
