"""`peagle-pipeline vllm-check`: load the target with an exported draft in vLLM and check it end to end.

The target runs twice with greedy decoding on the same prompts: once plain, once with the draft as a
parallel-drafting speculator (`method=eagle3, parallel_drafting=True`, which is how vLLM serves a speculators
P-EAGLE export). The outputs must be token-for-token identical (speculative decoding never changes greedy
output); the acceptance that vLLM itself measured (its spec-decode counters) is reported: mean acceptance
length = 1 + accepted / drafts, and the acceptance rate of each draft position. Never trains or writes a cache.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from peagle_pipeline.backends.pieces import read_target_info, text_config
from peagle_pipeline.backends.vllm import EngineSettings, build_llm
from peagle_pipeline.errors import BadInput, SpeculativeMismatch
from peagle_pipeline.runtime import atomic_write_json

__all__ = ["run", "CheckReport", "SpeculativeMismatch", "load_prompts", "read_draft_config", "spec_counters"]

log = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 1024  # longer prompts are skipped: the check is about decoding, not long prefills
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
SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


@dataclass
class CheckReport:
    """What `vllm-check` measured; `to_json()` is the report file."""

    draft: str
    target: str
    depths: int
    dtype: str
    max_tokens: int
    prompts: int
    identical: bool
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    plain_seconds: float = 0.0
    speculative_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens produced per target verification step: 1 + accepted / drafts."""
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of drafts whose position i (0-based) was accepted."""
        return [a / self.drafts if self.drafts else float("nan") for a in self.accepted_per_position]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["acceptance_length"] = self.acceptance_length if self.drafts else None  # no NaN in JSON
        out["acceptance_per_position"] = self.acceptance_per_position if self.drafts else None
        return out

    def table(self) -> str:
        """A small human-readable summary."""
        lines = [
            f"draft {self.draft} on {self.target} (K={self.depths}, {self.dtype}, {self.prompts} prompts x "
            f"{self.max_tokens} tokens)",
            f"greedy output identical to plain decoding: {'yes' if self.identical else 'NO'}"
            + ("" if self.identical else f" ({len(self.mismatches)} prompts differ)"),
            f"vLLM-measured acceptance length: {self.acceptance_length:.3f} "
            f"({self.accepted} accepted / {self.drafts} drafts, {self.draft_tokens} draft tokens)",
            "position  accepted  rate",
        ]
        for i, (n, r) in enumerate(
            zip(self.accepted_per_position, self.acceptance_per_position, strict=True)
        ):
            lines.append(f"{i + 1:>8}  {n:>8}  {r:.3f}")
        tps_plain = self.generated_tokens / self.plain_seconds if self.plain_seconds else 0.0
        tps_spec = self.generated_tokens / self.speculative_seconds if self.speculative_seconds else 0.0
        lines.append(f"generation: plain {tps_plain:.1f} tok/s, speculative {tps_spec:.1f} tok/s")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- inputs


def read_draft_config(draft_dir: str | Path) -> dict[str, Any]:
    """The export's config.json, checked to be a speculators P-EAGLE export.

    Raises:
        BadInput: missing/unreadable config or not `speculators_model_type: peagle`.
    """
    path = Path(draft_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BadInput(
            f"{draft_dir} is not a draft export: cannot read {path.name} ({type(err).__name__})"
        ) from None
    if config.get("speculators_model_type") != "peagle":
        raise BadInput(
            f"{draft_dir} is not a P-EAGLE export (speculators_model_type is "
            f"{config.get('speculators_model_type')!r}); export one with `peagle-pipeline export`"
        )
    return config


def _draft_depths(config: dict[str, Any]) -> int:
    try:
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise BadInput(
            "draft config lacks speculators_config.proposal_methods[0].speculative_tokens"
        ) from None


def load_prompts(source: str | None, target: str, num_prompts: int) -> list[list[int]]:
    """Up to `num_prompts` prompts as token ids, rendered with the target's chat template.

    Args:
        source: None (built-in prompts); a JSONL file of `{"prompt": str}` records; a chat data file
            (ShareGPT/OpenAI JSON, JSONL or Parquet: the conversation up to its last user turn is the prompt);
            or a cache directory (the context before the first supervised token of its held-out samples,
            split as training does with the default seed and eval_samples).
        target: target model directory (tokenizer and chat template).
        num_prompts: how many prompts to return at most.

    Raises:
        BadInput: unreadable source or no usable prompt in it.
    """
    if num_prompts <= 0:
        raise BadInput(f"num_prompts must be positive, got {num_prompts}")
    if source is not None and Path(source).is_dir() and _is_cache(source):
        prompts = list(_cache_prompts(source, num_prompts))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
        prompts = []
        for messages in _message_lists(source):
            ids = _render(tokenizer, messages)
            if 0 < len(ids) <= MAX_PROMPT_TOKENS:
                prompts.append(ids)
            if len(prompts) == num_prompts:
                break
    if not prompts:
        raise BadInput(f"no usable prompt (1..{MAX_PROMPT_TOKENS} tokens) in {source}")
    return prompts


def _is_cache(path: str) -> bool:
    from peagle_pipeline.cache import layout

    return (Path(path) / layout.CACHE_META).is_file()


def _cache_prompts(path: str, n: int) -> Iterator[list[int]]:
    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.config import TrainConfig
    from peagle_pipeline.stages.loader import split_samples

    defaults = TrainConfig(cache=path, output="unused")
    cache = open_cache(path)
    split = split_samples(cache.samples, defaults.eval_samples, defaults.seed)
    given = 0
    for sample_id in split.eval_ids.tolist():
        sample = cache.read_sample(int(sample_id))
        mask = sample.loss_mask
        first = int(mask.int().argmax()) if bool(mask.any()) else 0
        if 0 < first <= MAX_PROMPT_TOKENS:
            yield sample.input_ids[:first].tolist()
            given += 1
            if given == n:
                return


def _message_lists(source: str | None) -> Iterator[list[dict[str, str]]]:
    """Chat message lists ending with a user turn, from the built-in prompts or a file."""
    if source is None:
        for text in DEFAULT_PROMPTS:
            yield [{"role": "user", "content": text}]
        return
    path = Path(source)
    if not path.exists():
        raise BadInput(f"prompt file not found: {source}")
    if path.suffix in (".jsonl", ".ndjson") and _first_record_has_prompt(path):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        prompt = json.loads(line).get("prompt")
                    except (ValueError, AttributeError):
                        raise BadInput(
                            f"{path}: a line is not a JSON object with a 'prompt' string"
                        ) from None
                    if isinstance(prompt, str) and prompt.strip():
                        yield [{"role": "user", "content": prompt}]
        return
    from peagle_pipeline.data.formats import Conversation, iter_rows

    for row in iter_rows([source]):
        if not isinstance(row, Conversation):
            continue
        msgs = [{"role": m.role, "content": m.content} for m in row.messages]
        while msgs and msgs[-1]["role"] != "user":
            msgs.pop()
        if msgs:
            yield msgs


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


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


# ------------------------------------------------------------------------------------------------ running


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters now (summed over engines): drafts, draft_tokens, accepted, per_pos."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {v: k for k, v in SPEC_METRICS.items()}
    for metric in llm.get_metrics():
        key = names.get(metric.name)
        if key == "per_pos":
            values = list(metric.values)
            prev = out["per_pos"] + [0] * (len(values) - len(out["per_pos"]))
            out["per_pos"] = [a + int(b) for a, b in zip(prev, values, strict=True)]
        elif key is not None:
            out[key] += int(metric.value)
    return out


def _generate(
    settings: EngineSettings,
    prompts: list[list[int]],
    max_tokens: int,
    speculative_config: dict[str, Any] | None,
) -> tuple[list[list[int]], float, dict[str, Any]]:
    """Greedy generation in a fresh engine; returns token ids per prompt, seconds, spec counters (deltas)."""
    from vllm import SamplingParams

    llm = build_llm(settings, speculative_config=speculative_config, disable_log_stats=False)
    try:
        before = spec_counters(llm)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = spec_counters(llm)
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
    delta = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    base = before["per_pos"] + [0] * (len(after["per_pos"]) - len(before["per_pos"]))
    delta["per_pos"] = [a - b for a, b in zip(after["per_pos"], base, strict=True)]
    return [list(o.outputs[0].token_ids) for o in outs], seconds, delta


def _mismatches(plain: list[list[int]], spec: list[list[int]]) -> list[dict[str, Any]]:
    out = []
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            out.append(
                {
                    "prompt": i,
                    "first_difference": pos,
                    "plain": a[pos : pos + 8],
                    "speculative": b[pos : pos + 8],
                    "plain_length": len(a),
                    "speculative_length": len(b),
                }
            )
    return out


def run(
    draft_dir: str,
    target: str,
    *,
    prompts: str | None = None,
    num_prompts: int = 8,
    max_tokens: int = 64,
    depths: int | None = None,
    report: str | None = None,
    dtype: Literal["bf16", "fp32"] = "bf16",
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    echo: Callable[[str], None] | None = None,
) -> CheckReport:
    """Check an exported draft in vLLM: greedy equality with plain decoding, and vLLM's measured acceptance.

    Args:
        draft_dir: P-EAGLE export (config.json + model.safetensors).
        target: target model directory (the verifier).
        prompts: prompt source (see `load_prompts`); None = built-in prompts.
        num_prompts: prompts to generate for.
        max_tokens: tokens generated per prompt.
        depths: num_speculative_tokens (default: the draft's K).
        report: write the JSON report here (also when the outputs differ).
        dtype: model dtype in vLLM.
        tensor_parallel_size, gpu_memory_utilization: vLLM engine options.
        echo: where the summary table goes (the CLI passes its printer); default: the log.

    Returns:
        The CheckReport.

    Raises:
        BadInput: not an export, draft/target mismatch, bad options, vLLM refused to start.
        SpeculativeMismatch: speculative greedy output differs from plain greedy output.
    """
    try:
        import vllm  # noqa: F401  (imported below anyway; a missing or broken install is a setup problem)
    except ImportError as err:
        raise BadInput(
            f"vllm-check needs vLLM, which {sys.executable} cannot import ({err}): install it (`make setup-vllm` "
            "creates .venv-vllm) and run vllm-check with that environment's peagle-pipeline"
        ) from None
    config = read_draft_config(draft_dir)
    info = read_target_info(target)
    draft_vocab = int(config.get("transformer_layer_config", {}).get("vocab_size", info.vocab_size))
    if draft_vocab != info.vocab_size:
        raise BadInput(
            f"draft {draft_dir} was trained for a vocabulary of {draft_vocab}, target {target} has "
            f"{info.vocab_size}: give the target the draft was trained on"
        )
    K = depths if depths is not None else _draft_depths(config)
    if K <= 0 or max_tokens <= 0:
        raise BadInput(f"depths and max_tokens must be positive, got {K} and {max_tokens}")
    ids = load_prompts(prompts, target, num_prompts)
    max_pos = int(text_config(info.config).get("max_position_embeddings") or 4096)
    settings = EngineSettings(
        model=target,
        dtype=dtype,
        max_model_len=min(max_pos, max(map(len, ids)) + max_tokens + K + 1),
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
    )
    speculative = {
        "model": str(Path(draft_dir).resolve()),
        "method": "eagle3",
        "parallel_drafting": True,
        "num_speculative_tokens": K,
    }
    plain, plain_s, _ = _generate(settings, ids, max_tokens, None)
    spec, spec_s, counters = _generate(settings, ids, max_tokens, speculative)
    result = CheckReport(
        draft=str(draft_dir),
        target=str(target),
        depths=K,
        dtype=dtype,
        max_tokens=max_tokens,
        prompts=len(ids),
        identical=plain == spec,
        mismatches=_mismatches(plain, spec),
        drafts=counters["drafts"],
        draft_tokens=counters["draft_tokens"],
        accepted=counters["accepted"],
        accepted_per_position=counters["per_pos"],
        generated_tokens=sum(map(len, spec)),
        plain_seconds=plain_s,
        speculative_seconds=spec_s,
    )
    (echo or log.info)(result.table())
    if report is not None:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(report, result.to_json())
    if not result.identical:
        first = result.mismatches[0]
        raise SpeculativeMismatch(
            f"speculative greedy output differs from plain greedy output on {len(result.mismatches)} of "
            f"{len(ids)} prompts (first: prompt {first['prompt']} at token {first['first_difference']})"
            + (f"; details in {report}" if report else "")
        )
    return result
