"""A Qwen3 target end to end: a tiny random Qwen3ForCausalLM with Qwen3's real chat template, extracted,
trained and exported with the real CLI; then what the export says about its target and its draft layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_run import peagle
from tiny import add_stop_bias, write_conversations

from peagle_pipeline.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_run(tiny_qwen3: Path, tmp_path_factory) -> Path:
    """A 2-step run on a Qwen3 cache (3 distinct aux layers, K=3), exported to RUN/export."""
    tmp = tmp_path_factory.mktemp("qwen3-run")
    data = write_conversations(tmp / "conv.jsonl", 24)
    cache = tmp / "cache"
    peagle(
        *["extract", "--model", str(tiny_qwen3), "--data", str(data), "--output", str(cache)],
        *["--dtype", "fp32", "--max-length", "256", "--shard-tokens", "2048", "--layers", "0,1,2"],
    )
    run = tmp / "run"
    proc = peagle(
        *["train", "--cache", str(cache), "--output", str(run), "--depths", "3", "--tokens-per-step", "256"],
        *[
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--save-every",
            "2",
            "--eval-samples",
            "4",
            "--precision",
            "fp32",
        ],
        *["--num-workers", "0"],
    )
    (run / "train-output.txt").write_text(proc.stdout + proc.stderr)
    return run


# ---- the draft layer is a Qwen3 layer that starts from the target's, q_norm/k_norm included --------------
def test_train_makes_a_qwen3_draft_layer_and_exports_it(qwen3_run: Path, tiny_qwen3: Path) -> None:
    from safetensors.torch import load_file

    out = (qwen3_run / "train-output.txt").read_text()
    assert "draft layers: Qwen3 architecture (q_norm/k_norm, as the target)" in out
    assert "draft layer 0 starts from target layer 3 with its q_norm/k_norm" in out
    layer = json.loads((qwen3_run / "export" / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["architectures"] == ["Qwen3ForCausalLM"]
    weights = load_file(str(qwen3_run / "export" / "model.safetensors"))
    D = layer["head_dim"]
    assert weights["layers.0.self_attn.q_norm.weight"].shape == (D,)
    assert weights["layers.0.self_attn.k_norm.weight"].shape == (D,)


def test_the_fused_layer_starts_from_the_target_layers_qk_norms(qwen3_run: Path, tiny_qwen3: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.config import TrainConfig, resolve
    from peagle_pipeline.stages.export.speculators_format import load_export
    from peagle_pipeline.stages.train.draft import build_draft

    cache = open_cache(str(qwen3_run.parent / "cache"))
    cfg = resolve(TrainConfig, None, {"cache": str(cache.path), "output": str(qwen3_run.parent / "new-run")})
    model, spec, _ = build_draft(cache, cfg)
    target = load_file(str(tiny_qwen3 / "model.safetensors"))
    attn = model.layers[0].self_attn
    assert spec.qk_norm and model.cfg.qk_norm
    for name in ("q_norm", "k_norm"):
        want = target[f"model.layers.3.self_attn.{name}.weight"]
        assert not torch.equal(want, torch.ones_like(want))  # tiny.py draws them away from 1
        assert torch.equal(getattr(attn, name).weight.detach(), want)
    loaded = load_export(qwen3_run / "export", torch.float32)
    assert loaded.cfg.qk_norm  # an export reloads as the Qwen3 layer it was trained as


# ---- a draft run against another target is refused before any engine starts ----------------------------
def test_export_records_the_target_it_was_trained_on(qwen3_run: Path, tiny_qwen3: Path) -> None:
    from peagle_pipeline.stages.export.marker import read_marker, target_identity

    assert read_marker(qwen3_run / "export")["target"] == target_identity(tiny_qwen3)


def test_evaluate_refuses_a_draft_trained_on_another_target(
    qwen3_run: Path, tiny_model: Path, tiny_qwen3: Path, capsys
) -> None:
    from peagle_pipeline.stages.export.marker import check_served_target

    export = str(qwen3_run / "export")
    # the tiny Llama has the same vocabulary size: only the recorded identity tells the targets apart
    code = main(["evaluate", export, "--target", str(tiny_model)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "was trained on another target than" in err and "config and tokenizer differ" in err
    assert "--allow-other-target" in err
    note = check_served_target(export, str(tiny_model), allow_other=True)  # what --allow-other-target prints
    assert note == f"warning: draft {export} was trained on another target (config and tokenizer differ)"
    assert check_served_target(export, str(tiny_qwen3)) is None  # its own target: nothing to say


def test_another_chat_template_only_warns(qwen3_run: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    from peagle_pipeline.stages.export.marker import check_served_target

    other = shutil.copytree(tiny_qwen3, tmp_path / "retemplated")
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    note = check_served_target(qwen3_run / "export", str(other))
    assert note is not None and note.startswith(f"warning: {other}'s chat template differs")


# ---- `generate --turns all` continues Qwen3 conversations past their first reply ------------------------
def _generate_rows(tiny_qwen3: Path, tmp_path: Path, **settings) -> tuple[list[dict], str, Path]:
    """`generate --backend hf --turns all` on 10 conversations with the tiny Qwen3 that ends its replies: the
    rows, the rejects' text and the model directory."""
    from peagle_pipeline.config import GenerateConfig
    from peagle_pipeline.data.onpolicy_files import rejects_file, rows_file
    from peagle_pipeline.stages.generate import stage

    model = add_stop_bias(
        shutil.copytree(tiny_qwen3, tmp_path / "qwen3-stop")
    )  # replies end after a few tokens
    data = write_conversations(tmp_path / "conv.jsonl", 10, seed=3)
    out = tmp_path / "gen"
    cfg = GenerateConfig(
        model=str(model),
        data=[str(data)],
        output=str(out),
        backend="hf",
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=24,
        batch_size=4,
        compute_dtype="fp32",
        device="cpu",
        **settings,
    )
    stage.run(cfg)
    rows = [json.loads(line) for line in (out / rows_file(0, 1)).read_text().splitlines()]
    return rows, (out / rejects_file(0, 1)).read_text(), model


def test_generate_all_turns_on_a_qwen3_target(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Every row is the conversation as Qwen3's template renders it, with the generated ids; later turns are made."""
    from transformers import AutoTokenizer

    rows, rejects, model = _generate_rows(tiny_qwen3, tmp_path)
    assert "rewrites" not in rejects and "prefix-stable" not in rejects
    assert (
        sum(len(r["finish"]) > 1 for r in rows) >= 2
    )  # multi-turn on-policy rows exist (2 of 10 at this seed)
    tok = AutoTokenizer.from_pretrained(model)
    for row in rows:
        if row["finish"][-1] != "stop":
            continue
        rendered = tok.apply_chat_template(row["messages"], tokenize=False)
        text = tok.decode(row["input_ids"])
        # As the template renders the messages, except the newest reply: the tiny model wrote it right after the
        # generation prompt (no <think> block), and the row holds it as generated, where Qwen3's template would
        # add an empty block to a whole-conversation rendering.
        assert rendered.replace("<think>\n\n</think>\n\n", "") == text + "\n"


def test_generate_without_thinking_on_a_qwen3_target(tiny_qwen3: Path, tmp_path: Path) -> None:
    """`chat_template_kwargs: {enable_thinking: false}`: each reply is prompted after the empty thinking block the
    template then adds, which it leaves out once the reply is an earlier turn; rows are the template's rendering
    exactly, and conversations go on past their first reply."""
    from transformers import AutoTokenizer

    rows, rejects, model = _generate_rows(
        tiny_qwen3, tmp_path, chat_template_kwargs={"enable_thinking": False}
    )
    assert "rewrites" not in rejects and "prefix-stable" not in rejects
    assert sum(len(r["finish"]) > 1 for r in rows) >= 2
    tok = AutoTokenizer.from_pretrained(model)
    stopped = [r for r in rows if r["finish"][-1] == "stop"]
    assert stopped
    for row in stopped:
        rendered = tok.apply_chat_template(row["messages"], tokenize=False, enable_thinking=False)
        assert rendered == tok.decode(row["input_ids"]) + "\n"
        assert rendered.count("<think>\n\n</think>\n\n") == 1  # before the newest reply only
    settings = json.loads((tmp_path / "gen" / "generate.json").read_text())["settings"]
    assert settings["chat_template_kwargs"] == {"enable_thinking": False}


def test_extract_records_the_template_variables_and_refuses_a_resume_with_others(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    data = write_conversations(tmp_path / "conv.jsonl", 6)
    cache = tmp_path / "cache"
    argv = [
        "extract",
        "--model",
        str(tiny_qwen3),
        "--data",
        str(data),
        "--output",
        str(cache),
        "--dtype",
        "fp32",
    ]
    peagle(*argv, "--chat-template-kwargs", '{"enable_thinking": false}')
    assert json.loads((cache / "cache.json").read_text())["chat_template_kwargs"] == {
        "enable_thinking": False
    }
    proc = peagle(*argv, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "chat_template_kwargs" in lines[0], proc.stderr
    proc = peagle(*argv, "--chat-template-kwargs", "{enable_thinking: false}", check=False)
    assert proc.returncode != 0 and proc.stderr.strip().startswith(
        "error: chat_template_kwargs must be a JSON"
    )


def test_a_qwen3_moe_target_starts_the_draft_from_its_attention(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    """Qwen3-MoE: the draft layer is a Qwen3 layer that starts from the last layer's attention and q/k norms; the
    layer's mixture of experts has no counterpart, so the draft's MLP starts at zero output."""
    data = write_conversations(tmp_path / "conv.jsonl", 16)
    cache, run = tmp_path / "cache", tmp_path / "run"
    peagle(
        *["extract", "--model", str(tiny_qwen3_moe), "--data", str(data), "--output", str(cache)],
        *["--dtype", "fp32", "--max-length", "256", "--layers", "0,1,2"],
    )
    proc = peagle(
        *["train", "--cache", str(cache), "--output", str(run), "--depths", "3", "--tokens-per-step", "256"],
        *["--steps", "2", "--eval-samples", "4", "--precision", "fp32", "--num-workers", "0"],
    )
    out = proc.stdout + proc.stderr
    assert "draft layers: Qwen3 architecture (q_norm/k_norm, as the target)" in out
    assert "starts from target layer 3's attention (its MLP is a mixture of experts" in out
    assert "with its q_norm/k_norm" in out
    layer = json.loads((run / "export" / "config.json").read_text())["transformer_layer_config"]
    assert (
        layer["model_type"] == "qwen3" and layer["intermediate_size"] == 128
    )  # the dense size, not an expert's


def test_a_template_variable_qwen3_never_reads_is_refused_by_every_command(
    qwen3_run: Path, tiny_qwen3: Path, tmp_path: Path, capsys
) -> None:
    """A misspelt `enable_thinking` would render the thinking-mode prompts as if no variable were given."""
    data = str(write_conversations(tmp_path / "conv.jsonl", 2))
    target = ["--model", str(tiny_qwen3), "--data", data]
    bad = ["--chat-template-kwargs", '{"enable_thinkng": false}']
    for argv in (
        ["generate", *target, "--output", str(tmp_path / "gen"), "--backend", "hf", "--max-new-tokens", "4"],
        ["extract", *target, "--output", str(tmp_path / "cache"), "--compute-dtype", "fp32"],
        ["evaluate", str(qwen3_run / "export"), "--target", str(tiny_qwen3)],
    ):
        code = main([*argv, *bad])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (argv[0], err)
        assert "enable_thinkng is never read" in err and "it reads: " in err and "enable_thinking" in err
    assert not (tmp_path / "gen").exists() and not (tmp_path / "cache").exists()
