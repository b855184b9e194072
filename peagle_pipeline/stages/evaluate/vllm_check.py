"""`peagle-pipeline vllm-check`: load the target with an exported draft in vLLM and check it end to end.

The target runs twice with greedy decoding on the same prompts: once plain, once with the draft as a
speculator (`method=eagle3`, with `parallel_drafting=True` for a speculators P-EAGLE export, without for an
EAGLE-3 one: `acceptance.speculative_config`). The outputs must be token-for-token identical (speculative decoding never changes greedy
output); the acceptance that vLLM itself measured (its spec-decode counters) is reported: mean acceptance
length = 1 + accepted / drafts, and the acceptance rate of each draft position. Never trains or writes a cache.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from peagle_pipeline.backends import vllm_log
from peagle_pipeline.backends.vllm import EngineSettings, require_vllm
from peagle_pipeline.config import VllmCheckConfig
from peagle_pipeline.errors import BadInput, SpeculativeMismatch
from peagle_pipeline.model_dir import read_target_info, text_config
from peagle_pipeline.preemption import stop_error
from peagle_pipeline.runtime import atomic_write_json
from peagle_pipeline.stages.evaluate.acceptance import (
    SpecCounters,
    draft_depths,
    engine,
    mismatches,
    read_draft_config,
    run_prompts,
    spec_counters,
    speculative_config,
)
from peagle_pipeline.stages.evaluate.prompts import DEFAULT_PROMPTS, load_prompts
from peagle_pipeline.stages.export.marker import check_served_target, export_run_dir
from peagle_pipeline.target_info import TargetInfo

__all__ = [
    "run",
    "CheckReport",
    "SpeculativeMismatch",
    "DEFAULT_PROMPTS",
    "load_prompts",
    "read_draft_config",
    "spec_counters",
]

log = logging.getLogger(__name__)


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
    def counters(self) -> SpecCounters:
        return SpecCounters(
            drafts=self.drafts,
            draft_tokens=self.draft_tokens,
            accepted=self.accepted,
            per_pos=tuple(self.accepted_per_position),
        )

    @property
    def acceptance_length(self) -> float:
        """Mean tokens produced per target verification step: 1 + accepted / drafts (NaN without drafts)."""
        al = self.counters.acceptance_length
        return float("nan") if al is None else al

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of drafts whose position i (0-based) was accepted."""
        rates = self.counters.acceptance_per_position
        return rates if rates is not None else [float("nan")] * len(self.accepted_per_position)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["acceptance_length"] = self.counters.acceptance_length  # None, never NaN, in JSON
        out["acceptance_per_position"] = self.counters.acceptance_per_position
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


def run(draft: str, target: str, *, echo: Callable[[str], None] | None = None, **options: Any) -> CheckReport:
    """Check an exported draft in vLLM: greedy equality with plain decoding, and vLLM's measured acceptance.

    Args:
        draft: a P-EAGLE or EAGLE-3 export (config.json + model.safetensors).
        target: target model directory (the verifier).
        echo: where the summary table goes (the CLI passes its printer); default: the log.
        options: the other `VllmCheckConfig` settings (their defaults and meaning are there): prompts (see
            `load_prompts`; None = built-in prompts), num_prompts, max_tokens, depths (default: the draft's K),
            report (the JSON report, also written when the outputs differ), dtype, tensor_parallel_size,
            gpu_memory_utilization, allow_other_target (a draft trained on another target, see
            `check_served_target`, runs with a warning).

    Returns:
        The CheckReport.

    Raises:
        BadInput: not an export, draft/target mismatch (vocabulary; config.json or tokenizer, see
            `check_served_target`), bad options, vLLM refused to start.
        SpeculativeMismatch: speculative greedy output differs from plain greedy output.
        Interrupted, Terminated: Ctrl-C or SIGTERM (nothing is kept: the message says so).
    """
    cfg = VllmCheckConfig(draft=draft, target=target, **options)
    say = echo or log.info
    beside = (
        Path(cfg.report).parent if cfg.report else None
    )  # vLLM's own output: beside the report, else a temp file
    vllm_log.route_to(beside if beside is not None and beside.is_dir() else None)
    try:
        result = _check(cfg, say, echo or log.warning)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: nothing was written, nothing is kept
        raise stop_error(stop, STOPPED) from None
    say(result.table())
    _publish(result, cfg.report)
    return result


STOPPED = ": vllm-check keeps no partial work (its report is written at the end); re-run the same command"


def _check(cfg: VllmCheckConfig, say: Callable[[str], None], warn: Callable[[str], None]) -> CheckReport:
    """Both engine runs and their comparison (see `run`); `warn` gets the note of a draft of another target."""
    draft_dir, target, dtype, max_tokens = cfg.draft, cfg.target, cfg.dtype, cfg.max_tokens
    K, info = _check_request(draft_dir, target, cfg.depths, max_tokens, dtype)
    note = check_served_target(draft_dir, target, cfg.allow_other_target)  # before any engine starts
    if note:
        warn(note)
    ids = load_prompts(cfg.prompts, target, cfg.num_prompts, run_dir=export_run_dir(draft_dir))
    max_pos = int(text_config(info.config).get("max_position_embeddings") or 4096)
    settings = EngineSettings(
        model=target,
        dtype=dtype,
        max_model_len=min(max_pos, max(map(len, ids)) + max_tokens + K + 1),
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
    )
    say(f"plain target {target}: {len(ids)} prompts x {max_tokens} tokens")
    with engine(settings, None) as (llm, started):
        plain = run_prompts(llm, ids, max_tokens=max_tokens)
    say(f"  engine started in {started:.1f} s; generated in {plain.seconds:.1f} s")
    say(f"with draft {draft_dir} (K={K})")
    with engine(settings, speculative_config(draft_dir, K)) as (llm, started):
        spec = run_prompts(llm, ids, max_tokens=max_tokens)
    say(f"  engine started in {started:.1f} s; generated in {spec.seconds:.1f} s")
    counters = spec.counters
    return CheckReport(
        draft=str(draft_dir),
        target=str(target),
        depths=K,
        dtype=dtype,
        max_tokens=max_tokens,
        prompts=len(ids),
        identical=plain.outputs == spec.outputs,
        mismatches=mismatches(plain.outputs, spec.outputs),
        drafts=counters.drafts,
        draft_tokens=counters.draft_tokens,
        accepted=counters.accepted,
        accepted_per_position=list(counters.per_pos),
        generated_tokens=spec.output_tokens,
        plain_seconds=plain.seconds,
        speculative_seconds=spec.seconds,
    )


def _check_request(
    draft_dir: str, target: str, depths: int | None, max_tokens: int, dtype: str
) -> tuple[int, TargetInfo]:
    """Everything `run` checks before starting vLLM; returns K (num_speculative_tokens) and the target's info.

    Raises:
        BadInput: vLLM not importable, not an export, draft/target vocabulary mismatch, bad options.
    """
    try:
        with vllm_log.quiet():  # (vLLM prints as it loads)
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
    K = depths if depths is not None else draft_depths(config)
    if K <= 0 or max_tokens <= 0:
        raise BadInput(f"depths and max_tokens must be positive, got {K} and {max_tokens}")
    if dtype not in ("bf16", "fp32"):
        raise BadInput(f"--dtype must be bf16 or fp32, got {dtype!r}")
    require_vllm()
    return K, info


def _publish(result: CheckReport, report: str | None) -> None:
    """Write the JSON report (also when the outputs differ), then raise if they differ.

    Raises:
        SpeculativeMismatch: speculative greedy output differs from plain greedy output.
    """
    if report is not None:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(report, result.to_json())
    if not result.identical:
        first = result.mismatches[0]
        raise SpeculativeMismatch(
            f"speculative greedy output differs from plain greedy output on {len(result.mismatches)} of "
            f"{result.prompts} prompts (first: prompt {first['prompt']} at token {first['first_difference']})"
            + (f"; details in {report}" if report else "")
        )
