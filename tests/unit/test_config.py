"""Config resolution: defaults < pipeline file < flags, unknown keys refused, values validated."""

from __future__ import annotations

import dataclasses

import pytest

from peagle_pipeline.config import (
    ExtractConfig,
    GenerateConfig,
    TrainConfig,
    describe_fields,
    resolve,
    to_dict,
)
from peagle_pipeline.errors import BadConfig

BASE_EXTRACT = {"model": "m", "data": ["d.jsonl"], "output": "out"}


def test_defaults_match_spec():
    cfg = resolve(ExtractConfig, None, BASE_EXTRACT)
    assert cfg.topk == 32 and cfg.layers is None and cfg.dtype == "bf16" and cfg.backend == "hf"
    t = resolve(TrainConfig, None, {"cache": "c", "output": "o"})
    assert (t.depths, t.lr, t.draft_vocab_size, t.grad_clip) == (8, 6e-4, 32000, 1.0)
    assert (t.down_sample_ratio, t.down_sample_ratio_min, t.max_anchors, t.draft_layers) == (0.7, 0.2, 512, 1)


def test_precedence_flag_over_yaml_over_default(tmp_path):
    pipe = tmp_path / "p.yaml"
    pipe.write_text(
        "extract:\n  model: m\n  data: d.jsonl\n  output: out\n  topk: 8\n  max-length: 99\n"
        "train:\n  cache: c\n  output: o\n"
    )
    cfg = resolve(ExtractConfig, pipe, {"topk": 4})
    assert cfg.topk == 4  # flag wins
    assert cfg.max_length == 99  # yaml (dash spelling accepted) beats default
    assert cfg.data == ["d.jsonl"]  # scalar promoted to list
    assert resolve(TrainConfig, pipe, {}).cache == "c"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"topkk": 3}, "did you mean 'topk'"),
        ({"topk": 0}, "topk must be positive"),
        ({"dtype": "fp16"}, "dtype must be one of"),
        ({"topk": "many"}, "topk must be of type int"),
        ({"layers": "2,-1"}, "layers must be non-negative"),
        ({"shard_tokens": 1000, "chunk_tokens": 512}, "multiple of chunk_tokens"),
    ],
)
def test_bad_values_are_one_line_errors(overrides, needle):
    with pytest.raises(BadConfig) as info:
        resolve(ExtractConfig, None, {**BASE_EXTRACT, **overrides})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_generate_section_and_values(tmp_path):
    pipe = tmp_path / "p.yaml"
    pipe.write_text("generate:\n  model: m\n  data: d.jsonl\n  output: g\n  turns: first\n  temperature: 0\n")
    cfg = resolve(GenerateConfig, pipe, {"samples_per_prompt": 1})
    assert (cfg.turns, cfg.temperature, cfg.samples_per_prompt, cfg.backend) == ("first", 0.0, 1, "auto")
    assert (cfg.top_p, cfg.max_new_tokens, cfg.compute_dtype) == (0.95, 1024, "auto")
    base = {"model": "m", "data": ["d"], "output": "o"}
    for bad, needle in (
        ({"turns": "middle"}, "turns must be one of"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens must be positive"),
        ({"backend": "tgi"}, "backend must be one of"),
    ):
        with pytest.raises(BadConfig, match=needle.replace("(", r"\(").replace("]", r"\]")):
            resolve(GenerateConfig, None, {**base, **bad})


def test_missing_required_names_the_flag():
    with pytest.raises(BadConfig, match="--model"):
        resolve(ExtractConfig, None, {"data": ["x"], "output": "o"})


def test_bad_pipeline_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("extract: [1, 2\n")
    with pytest.raises(BadConfig, match="not valid YAML"):
        resolve(ExtractConfig, bad, BASE_EXTRACT)
    other = tmp_path / "other.yaml"
    other.write_text("extrct:\n  topk: 3\n")
    with pytest.raises(BadConfig, match="unknown section"):
        resolve(ExtractConfig, other, BASE_EXTRACT)
    with pytest.raises(BadConfig, match="not found"):
        resolve(ExtractConfig, tmp_path / "missing.yaml", BASE_EXTRACT)


def test_a_key_given_twice_in_a_pipeline_file_is_refused_in_one_line(tmp_path, capsys):
    """YAML itself keeps the last of two equal keys: the first value would be silently ignored."""
    from peagle_pipeline.cli import main

    twice = tmp_path / "twice.yaml"
    twice.write_text("extract:\n  topk: 8\n  max_length: 64\n  topk: 16\n")
    with pytest.raises(BadConfig, match=r"key 'topk' is given twice \(lines 2 and 4\)"):
        resolve(ExtractConfig, twice, BASE_EXTRACT)
    sections = tmp_path / "sections.yaml"
    sections.write_text("train:\n  steps: 3\nextract:\n  topk: 8\ntrain:\n  steps: 5\n")
    capsys.readouterr()
    assert main(["train", "-c", str(sections), "--cache", "c", "--output", "o"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: pipeline file {sections}: key 'train' is given twice (lines 1 and 5); keep one\n"


def test_every_field_is_documented_and_round_trips():
    for cls in (GenerateConfig, ExtractConfig, TrainConfig):
        for name, help_text, _ in describe_fields(cls):
            assert help_text, f"{cls.__name__}.{name} has no help"
    cfg = resolve(ExtractConfig, None, {**BASE_EXTRACT, "layers": [1, 3]})
    assert resolve(ExtractConfig, None, to_dict(cfg)) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.topk = 3  # type: ignore[misc]


def test_shipped_pipeline_files_resolve():
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[2].joinpath("pipelines").glob("*.yaml")):
        resolve(ExtractConfig, path, {})
        resolve(TrainConfig, path, {})
        resolve(GenerateConfig, path, {"model": "m", "data": ["d"], "output": "o"})


def test_generated_docs_are_current():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "scripts/gen_docs.py", "--check"], cwd=root, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout


BASE_TRAIN = {"cache": "c", "output": "o"}


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"lr": float("inf")}, "lr must be a finite number, got inf"),
        ({"lr": "nan"}, "lr must be a finite number, got nan"),
        ({"grad_clip": float("nan")}, "grad_clip must be a finite number"),
        ({"weight_decay": -5}, "weight_decay must be >= 0, got -5.0"),
        ({"weight_decay": "inf"}, "weight_decay must be a finite number"),
        ({"down_sample_ratio": float("nan")}, "down_sample_ratio must be a finite number"),
        ({"device": "banana"}, "device must be auto, cpu, cuda or cuda:N"),
        ({"method": "eagle2"}, "method must be one of"),
        ({"step_loss_decay": 0}, "step_loss_decay must be positive, got 0"),
        ({"method": "eagle3", "sequence_partitions": 2}, "method eagle3 runs each row whole"),
    ],
)
def test_float_and_device_settings_are_checked_at_parse_time(overrides, needle):
    """nan/inf slip through `x > 0` range checks; they (and a device torch cannot parse) are refused here."""
    with pytest.raises(BadConfig) as info:
        resolve(TrainConfig, None, {**BASE_TRAIN, **overrides})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_extract_float_and_device_settings_are_checked():
    with pytest.raises(BadConfig, match="gpu_memory_utilization must be a finite number"):
        resolve(ExtractConfig, None, {**BASE_EXTRACT, "gpu_memory_utilization": float("nan")})
    with pytest.raises(BadConfig, match="device must be"):
        resolve(ExtractConfig, None, {**BASE_EXTRACT, "device": "gpu0"})
    assert resolve(ExtractConfig, None, {**BASE_EXTRACT, "device": "cuda:1"}).device == "cuda:1"


def test_pipeline_file_that_is_a_directory(tmp_path):
    with pytest.raises(BadConfig, match="is a directory"):
        resolve(TrainConfig, tmp_path, BASE_TRAIN)


def test_field_choices_come_from_literal_types():
    from peagle_pipeline.config import field_choices

    assert field_choices(TrainConfig, "schedule") == ("cosine", "linear", "constant")
    assert field_choices(ExtractConfig, "backend") == ("hf", "vllm")
    assert field_choices(TrainConfig, "lr") == ()


def test_duplicate_data_and_layers_are_refused(tmp_path, monkeypatch):
    """The same data file twice (however spelled) or a layer id twice is a one-line error."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadConfig, match=r"data names the same file twice: 'd.jsonl' and '\./d.jsonl'"):
        resolve(ExtractConfig, None, {**BASE_EXTRACT, "data": ["d.jsonl", "e.jsonl", "./d.jsonl"]})
    with pytest.raises(BadConfig, match="data names the same file twice"):
        resolve(ExtractConfig, None, {**BASE_EXTRACT, "data": ["d.jsonl", str(tmp_path / "d.jsonl")]})
    with pytest.raises(BadConfig, match=r"layers names layer 3 twice \(\[2, 3, 3\]\)"):
        resolve(ExtractConfig, None, {**BASE_EXTRACT, "layers": "2,3,3"})
    cfg = resolve(ExtractConfig, None, {**BASE_EXTRACT, "data": ["d.jsonl", "e.jsonl"], "layers": "3,2"})
    assert cfg.data == ["d.jsonl", "e.jsonl"] and cfg.layers == [3, 2]


# ---- greedy sampling with several samples per prompt -----------------------------------------------------
def test_greedy_with_several_samples_per_prompt_is_refused(tmp_path):
    """temperature 0 is greedy: n samples of one prompt would be n byte-identical rows. One line names both fixes."""
    base = {"model": "m", "data": ["d"], "output": "o"}
    with pytest.raises(BadConfig) as info:
        resolve(GenerateConfig, None, {**base, "temperature": 0.0, "samples_per_prompt": 2})
    message = str(info.value)
    assert "\n" not in message and "identical" in message
    assert "temperature > 0" in message and "samples_per_prompt 1" in message
    pipe = tmp_path / "p.yaml"  # the same from a pipeline file
    pipe.write_text(
        "generate:\n  model: m\n  data: d.jsonl\n  output: g\n  temperature: 0\n  samples_per_prompt: 3\n"
    )
    with pytest.raises(BadConfig, match="identical samples"):
        resolve(GenerateConfig, pipe, {})
    assert (
        resolve(
            GenerateConfig, None, {**base, "temperature": 0.5, "samples_per_prompt": 2}
        ).samples_per_prompt
        == 2
    )
    assert resolve(GenerateConfig, None, {**base, "temperature": 0.0}).samples_per_prompt == 1


def test_chat_template_kwargs_from_a_flag_or_a_pipeline_file(tmp_path):
    """A JSON object on the command line, a mapping in a pipeline file; anything else, or one of
    apply_chat_template's own arguments, is a one-line error naming the setting."""
    flag = resolve(
        GenerateConfig, None, {**BASE_EXTRACT, "chat_template_kwargs": '{"enable_thinking": false}'}
    )
    assert flag.chat_template_kwargs == {"enable_thinking": False}
    assert resolve(ExtractConfig, None, BASE_EXTRACT).chat_template_kwargs == {}
    pipe = tmp_path / "p.yaml"
    pipe.write_text("extract:\n  chat_template_kwargs:\n    reasoning_effort: low\n")
    assert resolve(ExtractConfig, pipe, BASE_EXTRACT).chat_template_kwargs == {"reasoning_effort": "low"}
    for bad, needle in (
        ('{"enable_thinking": fals}', "must be a JSON object"),
        ("[1, 2]", "must be a mapping"),
        ('{"add_generation_prompt": true}', "add_generation_prompt is not a template variable"),
    ):
        with pytest.raises(BadConfig, match=needle) as info:
            resolve(ExtractConfig, None, {**BASE_EXTRACT, "chat_template_kwargs": bad})
        assert "chat_template_kwargs" in str(info.value) and "\n" not in str(info.value)
