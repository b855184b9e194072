"""Acceptance as vLLM measures it: spec-decode counters, the figures derived from them, and timed engine runs.

AL (mean acceptance length) = 1 + accepted / drafts from vLLM's counters `vllm:spec_decode_num_drafts`,
`vllm:spec_decode_num_accepted_tokens` and `..._per_pos`, differenced before/after a run (docs/reference/algorithm.md); the
per-position rate i is accepted_per_pos[i] / drafts. Runs keep at most `concurrency` requests in flight (1 = one
prompt at a time) and time only the measured prompts (a short warm-up request comes first).
Shared by `evaluate` and `vllm-check`. Never imports vLLM at module import time; never writes files.
"""

from __future__ import annotations

import contextlib
import gc
import json
import platform
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_pipeline.errors import BadInput
from peagle_pipeline.hardware import usable_cpus
from peagle_pipeline.stages.draft_spec import EXPORT_METHODS, export_method

__all__ = [
    "SPEC_METRICS",
    "SpecCounters",
    "EngineRun",
    "read_counters",
    "spec_counters",
    "run_prompts",
    "engine",
    "mismatches",
    "METHOD_NAMES",
    "read_draft_config",
    "draft_method",
    "draft_depths",
    "speculative_config",
    "describe_hardware",
    "ratio",
]

SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
WARMUP_TOKENS = 8  # the warm-up request before a timed run (not counted)


# ------------------------------------------------------------------------------------------------ figures


def ratio(num: float, den: float) -> float | None:
    """num / den, or None when den is 0 (reports hold null, never NaN)."""
    return num / den if den else None


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters (totals, or the difference of two snapshots).

    Attributes:
        drafts: verification steps that carried a draft.
        draft_tokens: drafted tokens proposed (drafts x K).
        accepted: drafted tokens accepted.
        per_pos: accepted tokens at draft position i (0-based), length K.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: tuple[int, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        base = before.per_pos + (0,) * (len(self.per_pos) - len(before.per_pos))
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted=self.accepted - before.accepted,
            per_pos=tuple(a - b for a, b in zip(self.per_pos, base, strict=False)),
        )

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens per target verification step: 1 + accepted / drafts (None without drafts)."""
        r = ratio(self.accepted, self.drafts)
        return None if r is None else 1.0 + r

    @property
    def acceptance_per_position(self) -> list[float] | None:
        """Fraction of drafts whose position i (0-based) was accepted (None without drafts)."""
        return [a / self.drafts for a in self.per_pos] if self.drafts else None

    def to_json(self) -> dict[str, Any]:
        return {
            "acceptance_length": self.acceptance_length,
            "acceptance_per_position": self.acceptance_per_position,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "accepted_per_position": list(self.per_pos),
        }


@dataclass
class EngineRun:
    """One timed pass over a prompt set: output token ids per prompt, seconds, and the counters' difference."""

    outputs: list[list[int]]
    seconds: float
    counters: SpecCounters = field(default_factory=SpecCounters)
    concurrency: int = 1

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def tokens_per_s(self) -> float | None:
        return ratio(self.output_tokens, self.seconds)


def mismatches(plain: list[list[int]], spec: list[list[int]]) -> list[dict[str, Any]]:
    """Prompts whose speculative output differs from the plain one: where, and a few tokens of each."""
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


# ------------------------------------------------------------------------------------------------ engines


def read_counters(llm: Any) -> SpecCounters:
    """vLLM's spec-decode counters now, summed over engines (zeros for a plain engine)."""
    totals: dict[str, int] = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    per_pos: list[int] = []
    names = {v: k for k, v in SPEC_METRICS.items()}
    for metric in llm.get_metrics():
        key = names.get(metric.name)
        if key == "per_pos":
            values = [int(v) for v in metric.values]
            per_pos = [
                a + b for a, b in zip(per_pos + [0] * (len(values) - len(per_pos)), values, strict=False)
            ]
        elif key is not None:
            totals[key] += int(metric.value)
    return SpecCounters(per_pos=tuple(per_pos), **totals)


def spec_counters(llm: Any) -> dict[str, Any]:
    """`read_counters` as a dict (drafts, draft_tokens, accepted, per_pos)."""
    c = read_counters(llm)
    return {
        "drafts": c.drafts,
        "draft_tokens": c.draft_tokens,
        "accepted": c.accepted,
        "per_pos": list(c.per_pos),
    }


@contextlib.contextmanager
def engine(settings: Any, speculative: dict[str, Any] | None) -> Iterator[tuple[Any, float]]:
    """A started vLLM engine (with stats on) and its start time in seconds; shut down on exit.

    Args:
        settings: `backends.vllm.EngineSettings` (prefix caching is always off).
        speculative: vLLM `speculative_config`, or None for the plain target.
    """
    from peagle_pipeline.backends.vllm import build_llm, shutdown_llm

    t0 = time.perf_counter()
    llm = build_llm(settings, in_process_on_cpu=True, speculative_config=speculative, disable_log_stats=False)
    started = time.perf_counter() - t0
    try:
        yield llm, started
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()


def run_prompts(
    llm: Any,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    concurrency: int = 1,
    warmup: bool = True,
) -> EngineRun:
    """Generate for every prompt with at most `concurrency` requests in flight; timed, counters differenced.

    Request i samples with seed `seed + i` (the same in every engine), so runs at T > 0 are repeatable.

    Returns:
        EngineRun with the output token ids in prompt order.
    """
    from peagle_pipeline.backends.vllm_log import quiet

    with quiet():  # vLLM's own output goes to its log file
        return _run_prompts(llm, prompts, max_tokens, temperature, seed, concurrency, warmup)


def _run_prompts(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float,
    seed: int,
    concurrency: int,
    warmup: bool,
) -> EngineRun:
    from vllm import SamplingParams

    def params(i: int, tokens: int) -> Any:
        return SamplingParams(
            temperature=temperature,
            max_tokens=tokens,
            seed=seed + i if temperature > 0 else None,
            detokenize=False,
        )

    if warmup and prompts:
        llm.generate(
            [{"prompt_token_ids": prompts[0]}], params(0, min(WARMUP_TOKENS, max_tokens)), use_tqdm=False
        )
    before = read_counters(llm)
    outputs: list[list[int] | None] = [None] * len(prompts)
    queue = deque(enumerate(prompts))
    in_flight: dict[str, int] = {}
    t0 = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            i, ids = queue.popleft()
            (rid,) = llm.enqueue([{"prompt_token_ids": ids}], params(i, max_tokens), use_tqdm=False)
            # enqueue returns the engine's internal id ("7-1a2b3c4d"); outputs carry the LLM's own counter ("7")
            in_flight[str(rid).split("-", 1)[0]] = i
        for out in llm.llm_engine.step():
            if out.finished and str(out.request_id) in in_flight:
                outputs[in_flight.pop(str(out.request_id))] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    counters = read_counters(llm) - before
    return EngineRun(
        outputs=[o if o is not None else [] for o in outputs],
        seconds=seconds,
        counters=counters,
        concurrency=concurrency,
    )


# ------------------------------------------------------------------------------------------------ drafts


# The speculators formats a draft export may have (`draft_spec.EXPORT_METHODS`): P-EAGLE drafts every position in
# one forward (vLLM's parallel drafting), EAGLE-3 one position per forward, each fed the one before.
METHOD_NAMES = {"peagle": "P-EAGLE", "eagle3": "EAGLE-3"}


def read_draft_config(draft_dir: str | Path) -> dict[str, Any]:
    """The export's config.json, checked to be a speculators export of ours (peagle or eagle3).

    Raises:
        BadInput: missing/unreadable config or a `speculators_model_type` other than peagle or eagle3.
    """
    path = Path(draft_dir) / "config.json"
    if not Path(draft_dir).is_dir():
        raise BadInput(f"draft export {draft_dir} not found")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BadInput(
            f"{draft_dir} is not a draft export: cannot read {path.name} ({type(err).__name__})"
        ) from None
    if export_method(config) is None:
        found = config.get("speculators_model_type") if isinstance(config, dict) else None
        raise BadInput(
            f"{draft_dir} is not a draft export (speculators_model_type is {found!r}, not one of "
            f"{', '.join(EXPORT_METHODS)}); export one with `peagle-pipeline export`"
        )
    return config


def draft_method(config: dict[str, Any]) -> str:
    """The method of a checked export config (`read_draft_config`): "peagle" or "eagle3"."""
    return str(export_method(config))


def draft_depths(config: dict[str, Any]) -> int:
    """K the draft was exported with (`speculators_config.proposal_methods[0].speculative_tokens`)."""
    try:
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise BadInput(
            "draft config lacks speculators_config.proposal_methods[0].speculative_tokens"
        ) from None


def speculative_config(draft_dir: str | Path, depths: int) -> dict[str, Any]:
    """vLLM's speculative_config for an export, K = `depths`: vLLM's EAGLE-3 proposer, with parallel drafting for a
    P-EAGLE export (all K tokens in one pass), without for an EAGLE-3 one (K sequential steps)."""
    parallel = draft_method(read_draft_config(draft_dir)) == "peagle"
    return {
        "model": str(Path(draft_dir).resolve()),
        "method": "eagle3",
        **({"parallel_drafting": True} if parallel else {}),
        "num_speculative_tokens": depths,
    }


# ------------------------------------------------------------------------------------------------ hardware


def describe_hardware(tensor_parallel_size: int) -> str:
    """The device the engine runs on: GPU name (x count), else the CPU model and the cores this process may use."""
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x {tensor_parallel_size}"
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {usable_cpus()} cores"
