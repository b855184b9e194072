"""`peagle-pipeline evaluate`: measure exported drafts in vLLM as peers measure them (docs/reference/algorithm.md).

One engine for the plain target, then one engine per draft and K (each shut down before the next starts, to bound
memory), all with the same settings and the same prompts. Drafts of either method compare in one run: a P-EAGLE
export is served with parallel drafting, an EAGLE-3 one without (each export's config.json says which), and each
draft may be measured at its own K list (`DIR@3-5`; `--depths` for the others). Per draft and prompt set: vLLM's acceptance length
(AL = 1 + accepted / drafts, counters differenced around the run), per-position acceptance, output tokens/s with and
without the draft and the speedup, at temperature T (default 0) with concurrency 1 for AL (or
`--acceptance-concurrency`); tokens/s also at every `--concurrency`. At T = 0 the speculative output is compared
with the plain output. The trainer's estimated AL (from the run's metrics.jsonl, at the exported checkpoint's step)
is reported beside vLLM's. Writes DIR/report.json, DIR/acceptance.png (per position) and DIR/comparison.png (AL and
speedup against K, a line per draft) when asked, and each draft's table into its export's model card (README.md,
`stages.evaluate.card_table`). Never trains and never writes a cache.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from peagle_pipeline.backends import vllm_log
from peagle_pipeline.config import EvaluateConfig
from peagle_pipeline.errors import BadInput
from peagle_pipeline.preemption import stop_error
from peagle_pipeline.stages.evaluate.acceptance import (
    METHOD_NAMES,
    EngineRun,
    describe_hardware,
    engine,
    mismatches,
    ratio,
    run_prompts,
    speculative_config,
)
from peagle_pipeline.stages.evaluate.drafts import (
    Draft,
    estimate_of_export,
    expand_depths,
    resolve_draft,
    split_draft_arg,
    walk_of_export,
)
from peagle_pipeline.stages.evaluate.prompts import PromptSet, load_prompt_set

if TYPE_CHECKING:
    from peagle_pipeline.backends.vllm import EngineSettings

__all__ = [
    "EvalOptions",
    "Measured",
    "REPORT_FILE",
    "CHART_FILE",
    "COMPARISON_FILE",
    "build_report",
    "finite",
    "run",
]

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"
CHART_FILE = "acceptance.png"
COMPARISON_FILE = "comparison.png"
MAX_MISMATCHES = 5  # mismatching prompts listed per row in the report


# The settings of `evaluate` (defaults, help and checks) are config.EvaluateConfig; EvalOptions is its name here.
EvalOptions = EvaluateConfig


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


# ------------------------------------------------------------------------------------------------ the report


def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (JSON null), recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def engine_dtype(requested: str, target: str) -> Literal["bf16", "fp32"]:
    """The vLLM model dtype: `requested`, or for auto the engine's rule (`vllm_dtype.engine_compute_dtype`) on the
    platform vLLM runs on here."""
    if requested != "auto":
        return requested  # type: ignore[return-value]
    from vllm.platforms import current_platform

    from peagle_pipeline.backends.vllm_dtype import engine_compute_dtype

    return engine_compute_dtype(requested, target, "cpu" if current_platform.is_cpu() else "cuda")


def _figure_settings(opts: EvalOptions, depths: int, concurrency: int, hardware: str) -> dict[str, Any]:
    return {
        "depths": depths,
        "temperature": opts.temperature,
        "max_tokens": opts.max_tokens,
        "concurrency": concurrency,
        "hardware": hardware,
    }


def _throughput(
    opts: EvalOptions,
    draft: Draft,
    prompt_set: PromptSet,
    plain: dict[tuple[str, int], EngineRun],
    spec: dict[tuple[str, str, int], EngineRun],
    hardware: str,
) -> list[dict[str, Any]]:
    """Tokens/s with and without `draft` on `prompt_set`, and the speedup, at every concurrency level."""
    throughput = []
    for c in opts.levels:
        sp, pl = spec[(draft.name, prompt_set.name, c)], plain[(prompt_set.name, c)]
        throughput.append(
            {
                **_figure_settings(opts, draft.depths, c, hardware),
                "output_tokens": sp.output_tokens,
                "seconds": sp.seconds,
                "tokens_per_s": sp.tokens_per_s,
                "plain_output_tokens": pl.output_tokens,
                "plain_seconds": pl.seconds,
                "plain_tokens_per_s": pl.tokens_per_s,
                "speedup": ratio(sp.tokens_per_s or 0.0, pl.tokens_per_s or 0.0),
                "acceptance_length": sp.counters.acceptance_length,
            }
        )
    return throughput


def _result_row(
    opts: EvalOptions,
    draft: Draft,
    prompt_set: PromptSet,
    plain: dict[tuple[str, int], EngineRun],
    spec: dict[tuple[str, str, int], EngineRun],
    hardware: str,
) -> dict[str, Any]:
    """The report's row of one draft on one prompt set: acceptance at the acceptance concurrency, the greedy
    comparison with the plain target, the trainer's estimate and the throughput at every level."""
    ac = opts.acceptance_concurrency
    al_run, base = spec[(draft.name, prompt_set.name, ac)], plain[(prompt_set.name, ac)]
    greedy = opts.temperature == 0
    diff = mismatches(base.outputs, al_run.outputs) if greedy else []
    return {
        "draft": draft.name,
        "label": draft.label,
        "method": draft.method,
        "prompt_set": prompt_set.name,
        "prompts": len(prompt_set.prompts),
        **_figure_settings(opts, draft.depths, ac, hardware),
        "trained_depths": draft.trained_depths,
        **al_run.counters.to_json(),
        "output_tokens": al_run.output_tokens,
        "identical": (not diff) if greedy else None,
        "mismatched_prompts": len(diff) if greedy else None,
        "mismatches": diff[:MAX_MISMATCHES],
        "trainer_estimate": estimate_of_export(draft.estimate),
        "trainer_walk": walk_of_export(draft.estimate),
        "throughput": _throughput(opts, draft, prompt_set, plain, spec, hardware),
    }


def _settings_json(opts: EvalOptions) -> dict[str, Any]:
    """The report's `settings`: what every measurement shared."""
    return {
        "temperature": opts.temperature,
        "max_tokens": opts.max_tokens,
        "num_prompts": opts.num_prompts,
        "depths": opts.depth_list,
        "concurrency": opts.levels,
        "acceptance_concurrency": opts.acceptance_concurrency,
        "seed": opts.seed,
        "prefix_caching": False,
        "tensor_parallel_size": opts.tensor_parallel_size,
        **({"chat_template_kwargs": opts.chat_template_kwargs} if opts.chat_template_kwargs else {}),
    }


@dataclass(frozen=True)
class Measured:
    """What the engines measured: `plain[(set, c)]`, `spec[(draft, set, c)]`, and each engine's start seconds by
    engine ("plain" or the draft's name)."""

    plain: dict[tuple[str, int], EngineRun]
    spec: dict[tuple[str, str, int], EngineRun]
    engine_seconds: dict[str, float]


def build_report(
    opts: EvalOptions,
    *,
    target: str,
    hardware: str,
    sets: list[PromptSet],
    drafts: list[Draft],
    measured: Measured,
    wall_seconds: float,
) -> dict[str, Any]:
    """The report (JSON-ready, no NaN) from what the engines `measured`.

    AL and per-position acceptance come from the run at `opts.acceptance_concurrency` (1 unless asked); tokens/s
    and speedup from each concurrency (the acceptance one is always measured, so it is always reported).
    """
    plain = measured.plain
    rows = [_result_row(opts, d, s, plain, measured.spec, hardware) for d in drafts for s in sets]
    report = {
        "target": target,
        "dtype": opts.dtype,
        "hardware": hardware,
        "settings": _settings_json(opts),
        "prompt_sets": [s.describe() for s in sets],
        "drafts": [d.to_json() for d in drafts],
        "engine_start_seconds": measured.engine_seconds,
        "plain": [
            {
                "prompt_set": s.name,
                "concurrency": c,
                "output_tokens": plain[(s.name, c)].output_tokens,
                "seconds": plain[(s.name, c)].seconds,
                "tokens_per_s": plain[(s.name, c)].tokens_per_s,
            }
            for s in sets
            for c in opts.levels
        ],
        "results": rows,
        "wall_seconds": wall_seconds,
    }
    return finite(report)


# ------------------------------------------------------------------------------------------------ running


def _measure(
    llm: Any, sets: list[PromptSet], opts: EvalOptions, levels: list[int], say: Callable[[str], None]
) -> dict[tuple[str, int], EngineRun]:
    """Every prompt set at every concurrency level on one engine; one progress line per run."""
    out = {}
    for s in sets:
        for c in levels:
            r = out[(s.name, c)] = run_prompts(
                llm,
                s.prompts,
                max_tokens=opts.max_tokens,
                temperature=opts.temperature,
                seed=opts.seed,
                concurrency=c,
            )
            say(
                f"  {s.name}, {c} in flight: {len(s.prompts)} prompts, {r.output_tokens} tokens in "
                f"{r.seconds:.1f} s ({format(r.tokens_per_s or 0.0, '.1f')} tokens/s)"
            )
    return out


STOPPED = ": evaluate keeps no partial work (its report is written at the end); re-run the same command"


def run(opts: EvalOptions, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every draft of `opts` on every prompt set; print the table; write the report and chart if asked.

    Returns:
        The report (see `build_report`).

    Raises:
        BadInput: a missing draft or target, not a P-EAGLE or EAGLE-3 export, a bad K list, drafts for another vocabulary or target
            (`check_served_target`), a bad prompt
            set, vLLM not installed or refusing to start.
        Interrupted, Terminated: Ctrl-C or SIGTERM (nothing is kept: the message says so).
    """
    try:
        return _run(opts, echo)
    except KeyboardInterrupt as stop:
        raise stop_error(stop, STOPPED) from None


def _resolve_drafts(opts: EvalOptions) -> list[Draft]:
    """Every measurement of `opts`, checked: each draft (under a name made unique, `name#2` for a repeated one) at
    each K of its own `DIR@KLIST`, else of `--depths`, else at its served K."""
    args = [split_draft_arg(a) for a in opts.drafts]
    drafts = [resolve_draft(path, None) for path, _ in args]
    for d, name in zip(drafts, _unique([d.name for d in drafts]), strict=True):
        d.name = name
    return [
        m
        for d, (_, ks) in zip(drafts, args, strict=True)
        for m in expand_depths(d, ks or opts.depth_list or [d.depths])
    ]


def _check_drafts(
    drafts: list[Draft], target: str, vocab_size: int, opts: EvalOptions, say: Callable[[str], None]
) -> None:
    """Refuse drafts for another vocabulary or target (unless allowed); note a K beyond the trained one.

    Raises:
        BadInput: a draft trained for another vocabulary size, or for another target (`check_served_target`).
    """
    from peagle_pipeline.stages.export.marker import check_served_target

    checked: set[str] = set()
    for d in drafts:
        if d.path in checked:  # the same export at another K
            continue
        checked.add(d.path)
        if d.vocab_size is not None and d.vocab_size != vocab_size:
            raise BadInput(
                f"draft {d.path} was trained for a vocabulary of {d.vocab_size}, target {target} has "
                f"{vocab_size}: give the target the draft was trained on"
            )
        note = check_served_target(d.path, target, opts.allow_other_target)
        if note:
            say(note)
    for d in drafts:
        if d.depths > d.trained_depths:
            say(
                f"note: {d.name} was trained for K={d.trained_depths}; measuring K={d.depths} (extra positions "
                "are drafted beyond what it learned)"
            )


def _measure_all(
    settings: EngineSettings,
    sets: list[PromptSet],
    drafts: list[Draft],
    opts: EvalOptions,
    say: Callable[[str], None],
) -> Measured:
    """The plain target, then each draft at each of its K, each on its own engine (shut down before the next
    starts)."""
    levels = opts.levels
    engine_seconds: dict[str, float] = {}
    with engine(settings, None) as (llm, started):
        engine_seconds["plain"] = started
        plain = _measure(llm, sets, opts, levels, say)
    spec: dict[tuple[str, str, int], EngineRun] = {}
    for d in drafts:
        say(f"draft {d.name} ({METHOD_NAMES[d.method]}, K={d.depths})")
        with engine(settings, speculative_config(d.path, d.depths)) as (llm, started):
            engine_seconds[d.name] = started
            for (set_name, c), r in _measure(llm, sets, opts, levels, say).items():
                spec[(d.name, set_name, c)] = r
    return Measured(plain, spec, engine_seconds)


def _write_outputs(report: dict[str, Any], output: Path, say: Callable[[str], None]) -> None:
    """OUTPUT/report.json, OUTPUT/acceptance.png and OUTPUT/comparison.png."""
    from peagle_pipeline.runtime import atomic_write_json
    from peagle_pipeline.stages.evaluate.report import plot_acceptance, plot_comparison

    output.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output / REPORT_FILE, report)
    plot_acceptance(report, output / CHART_FILE)
    plot_comparison(report, output / COMPARISON_FILE)
    say(f"wrote {output / REPORT_FILE}, {output / CHART_FILE} and {output / COMPARISON_FILE}")


def _run(opts: EvalOptions, echo: Callable[[str], None] | None) -> dict[str, Any]:
    from peagle_pipeline.backends.vllm import EngineSettings, require_vllm
    from peagle_pipeline.data.template_variables import check_template_kwargs
    from peagle_pipeline.model_dir import load_tokenizer, read_target_info, text_config
    from peagle_pipeline.stages.evaluate.card_table import refresh_cards
    from peagle_pipeline.stages.evaluate.report import format_table

    say = echo or log.info
    t_start = time.perf_counter()
    drafts = _resolve_drafts(opts)
    output = Path(opts.output) if opts.output else None
    if output is not None and output.exists() and not output.is_dir():
        raise BadInput(f"--output {output} is a file: give a directory for {REPORT_FILE} and {CHART_FILE}")
    target = opts.target or drafts[0].verifier
    if not target:
        raise BadInput("the draft does not name its target (verifier): give --target")
    info = read_target_info(target)
    _check_drafts(drafts, target, info.vocab_size, opts, say)
    tokenizer = load_tokenizer(target)
    check_template_kwargs(tokenizer, opts.chat_template_kwargs)  # before vLLM is needed or an engine starts
    require_vllm()
    dtype = engine_dtype(opts.dtype, target)
    opts = replace(opts, dtype=dtype)
    sets = [
        load_prompt_set(spec, tokenizer, opts.num_prompts, template_kwargs=opts.chat_template_kwargs)
        for spec in opts.prompts
    ]
    sets = [replace(s, name=n) for s, n in zip(sets, _unique([s.name for s in sets]), strict=True)]
    longest = max(len(p) for s in sets for p in s.prompts)
    max_pos = int(text_config(info.config).get("max_position_embeddings") or 4096)
    settings = EngineSettings(
        model=target,
        dtype=dtype,
        max_model_len=min(max_pos, longest + opts.max_tokens + max(d.depths for d in drafts) + 1),
        tensor_parallel_size=opts.tensor_parallel_size,
        gpu_memory_utilization=opts.gpu_memory_utilization,
    )
    vllm_log.route_to(output)  # vLLM's own output: OUTPUT/vllm.log (a temporary file without --output)
    say(f"plain target {target}: {sum(len(s.prompts) for s in sets)} prompts in {len(sets)} set(s)")
    measured = _measure_all(settings, sets, drafts, opts, say)
    # after the engines: naming a GPU initialises CUDA in this process, which vLLM prefers to do in its workers
    hardware = describe_hardware(opts.tensor_parallel_size)
    report = build_report(
        opts,
        target=target,
        hardware=hardware,
        sets=sets,
        drafts=drafts,
        measured=measured,
        wall_seconds=time.perf_counter() - t_start,
    )
    say(format_table(report))
    refresh_cards(report, {d.name: d.path for d in drafts}, say)  # each export's model card, where it has one
    if output is not None:
        _write_outputs(report, output, say)
    return report
