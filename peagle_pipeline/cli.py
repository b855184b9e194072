"""The `peagle-pipeline` command line: parse flags, resolve the config, call a stage. Nothing else.

`main()` is the one error boundary: a `PeagleError` becomes one line on stderr and its exit code, Ctrl-C exit 130, SIGTERM 143,
an OS error about a path (disk full, read-only, missing) its `errors.from_os_error` class; set PEAGLE_DEBUG=1 to see
the traceback instead. Heavy imports (torch, zarr) happen inside commands, so `--help`, `--version` and `plot`
start without torch. An option of a config field is built by `_opt(Config, "name")`: its help, default and allowed
values (for `Literal` fields) come from config/, the one source of truth.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from peagle_pipeline import preemption
from peagle_pipeline.config import (
    SECTIONS,
    SERVING_DEPTHS,
    EvaluateConfig,
    ExtractConfig,
    GenerateConfig,
    TrainConfig,
    VllmCheckConfig,
    describe_fields,
    field_choices,
    is_required,
    resolve,
)
from peagle_pipeline.errors import (
    BadInput,
    Busy,
    IncompatibleCache,
    Interrupted,
    OutputExists,
    PeagleError,
    RankLost,
    ResumeMismatch,
    from_os_error,
)
from peagle_pipeline.process_exit import skip_final_collection
from peagle_pipeline.runtime import drop_shipped_config_notices

__all__ = ["app", "main"]


class _Command(TyperCommand):
    """Usage lines name positional arguments plainly (`CACHE`, not typer's `{CACHE}`)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [
            p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)
        ]


class _App(typer.Typer):
    """Every command of the app uses `_Command` (so commands added later get plain usage lines too)."""

    def command(self, *args: Any, cls: type[TyperCommand] | None = _Command, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls, **kwargs)


app = _App(
    name="peagle-pipeline",
    help="Regenerate chat data with the target, extract its hidden states into a Zarr cache, then train "
    "P-EAGLE drafts for vLLM from it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: keeps "[elements, Vd]" and "[default: ...]" literally, no rich import
)


def _default_note(cls: type, name: str, default: Any) -> str:
    """ " [default: ...]" for the help line of field `name` ("" when there is nothing to show)."""
    if is_required(cls, name):  # typer itself marks a required flag of a command without a pipeline file
        return " [required: flag or pipeline file]" if cls in SECTIONS else ""
    if default in ("", [], None):
        return ""
    if isinstance(default, bool):
        flag = name.replace("_", "-")
        return f" [default: --{flag if default else 'no-' + flag}]"
    if isinstance(default, list):
        return f" [default: {','.join(map(str, default))}]"
    return f" [default: {default}]"


def _field_help(cls: type) -> dict[str, str]:
    return {name: help + _default_note(cls, name, default) for name, help, default in describe_fields(cls)}


_EXTRACT_HELP = _field_help(ExtractConfig)
_TRAIN_HELP = _field_help(TrainConfig)


def _E(name: str) -> str:
    return _EXTRACT_HELP[name]


def _T(name: str) -> str:
    return _TRAIN_HELP[name]


def _opt(cls: type, name: str) -> Any:
    """The typer option of config field `name`: `--name` (`--name/--no-name` for bools), help with the default,
    the allowed values as metavar for `Literal` fields (or the field's `metavar`). The parameter itself defaults
    to None ("not given"). A field marked `argument` is a positional argument instead."""
    flag = "--" + name.replace("_", "-")
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    choices = field_choices(cls, name)
    help_text = _field_help(cls)[name]
    metavar = f.metadata.get("metavar") or ("[" + "|".join(choices) + "]" if choices else None)
    if f.metadata.get("argument"):
        return typer.Argument(help=help_text, metavar=metavar)
    decls = [f"{flag}/--no-{flag[2:]}"] if str(f.type).startswith("bool") else [flag]
    return typer.Option(*decls, help=help_text, metavar=metavar)


def _version(value: bool) -> None:
    if value:
        from peagle_pipeline import __version__

        typer.echo(f"peagle-pipeline {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Extract target hidden states into a Zarr cache, then train P-EAGLE drafts for vLLM from it."""


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Pipeline file (YAML); flags override its section.", metavar="FILE"),
]


def _overrides(local: dict[str, Any]) -> dict[str, Any]:
    """The flags the user actually gave (typer passes None for the rest)."""
    return {k: v for k, v in local.items() if k != "config" and v is not None}


def _given(local: dict[str, Any]) -> dict[str, Any]:
    """The arguments and flags given to a command without a pipeline file (an unrepeated list option may come as
    an empty list): the config's defaults fill the rest."""
    return {k: v for k, v in _overrides(local).items() if v != []}


@app.command()
def generate(
    config: ConfigOpt = None,
    model: Annotated[str | None, _opt(GenerateConfig, "model")] = None,
    data: Annotated[list[str] | None, _opt(GenerateConfig, "data")] = None,
    split: Annotated[str | None, _opt(GenerateConfig, "split")] = None,
    output: Annotated[str | None, _opt(GenerateConfig, "output")] = None,
    backend: Annotated[str | None, _opt(GenerateConfig, "backend")] = None,
    turns: Annotated[str | None, _opt(GenerateConfig, "turns")] = None,
    thinking: Annotated[str | None, _opt(GenerateConfig, "thinking")] = None,
    temperature: Annotated[float | None, _opt(GenerateConfig, "temperature")] = None,
    top_p: Annotated[float | None, _opt(GenerateConfig, "top_p")] = None,
    repetition_penalty: Annotated[float | None, _opt(GenerateConfig, "repetition_penalty")] = None,
    max_new_tokens: Annotated[int | None, _opt(GenerateConfig, "max_new_tokens")] = None,
    max_prompt_tokens: Annotated[int | None, _opt(GenerateConfig, "max_prompt_tokens")] = None,
    samples_per_prompt: Annotated[int | None, _opt(GenerateConfig, "samples_per_prompt")] = None,
    seed: Annotated[int | None, _opt(GenerateConfig, "seed")] = None,
    max_samples: Annotated[int | None, _opt(GenerateConfig, "max_samples")] = None,
    chunk_size: Annotated[int | None, _opt(GenerateConfig, "chunk_size")] = None,
    batch_size: Annotated[int | None, _opt(GenerateConfig, "batch_size")] = None,
    rank: Annotated[int | None, _opt(GenerateConfig, "rank")] = None,
    world_size: Annotated[int | None, _opt(GenerateConfig, "world_size")] = None,
    device: Annotated[str | None, _opt(GenerateConfig, "device")] = None,
    compute_dtype: Annotated[str | None, _opt(GenerateConfig, "compute_dtype")] = None,
    chat_template_kwargs: Annotated[str | None, _opt(GenerateConfig, "chat_template_kwargs")] = None,
    tensor_parallel_size: Annotated[int | None, _opt(GenerateConfig, "tensor_parallel_size")] = None,
    gpu_memory_utilization: Annotated[float | None, _opt(GenerateConfig, "gpu_memory_utilization")] = None,
) -> None:
    """Regenerate the assistant replies of chat data with the target (on-policy rows that extract reads)."""
    cfg = resolve(GenerateConfig, config, _overrides(locals()))
    from peagle_pipeline.stages.generate import stage

    summary = stage.run(cfg, echo=lambda line: typer.echo(line, err=True))
    typer.echo(summary.format())


@app.command()
def extract(
    config: ConfigOpt = None,
    model: Annotated[str | None, _opt(ExtractConfig, "model")] = None,
    data: Annotated[list[str] | None, _opt(ExtractConfig, "data")] = None,
    split: Annotated[str | None, _opt(ExtractConfig, "split")] = None,
    output: Annotated[str | None, _opt(ExtractConfig, "output")] = None,
    backend: Annotated[str | None, _opt(ExtractConfig, "backend")] = None,
    layers: Annotated[str | None, _opt(ExtractConfig, "layers")] = None,
    topk: Annotated[int | None, _opt(ExtractConfig, "topk")] = None,
    last_hidden: Annotated[bool | None, _opt(ExtractConfig, "last_hidden")] = None,
    max_length: Annotated[int | None, _opt(ExtractConfig, "max_length")] = None,
    overlong: Annotated[str | None, _opt(ExtractConfig, "overlong")] = None,
    max_samples: Annotated[int | None, _opt(ExtractConfig, "max_samples")] = None,
    batch_tokens: Annotated[int | None, _opt(ExtractConfig, "batch_tokens")] = None,
    length_window: Annotated[int | None, _opt(ExtractConfig, "length_window")] = None,
    dtype: Annotated[str | None, _opt(ExtractConfig, "dtype")] = None,
    compute_dtype: Annotated[str | None, _opt(ExtractConfig, "compute_dtype")] = None,
    assistant_turns: Annotated[str | None, _opt(ExtractConfig, "assistant_turns")] = None,
    leading_assistant: Annotated[str | None, _opt(ExtractConfig, "leading_assistant")] = None,
    chat_template_kwargs: Annotated[str | None, _opt(ExtractConfig, "chat_template_kwargs")] = None,
    compress: Annotated[str | None, _opt(ExtractConfig, "compress")] = None,
    shard_tokens: Annotated[int | None, _opt(ExtractConfig, "shard_tokens")] = None,
    chunk_tokens: Annotated[int | None, _opt(ExtractConfig, "chunk_tokens")] = None,
    rank: Annotated[int | None, _opt(ExtractConfig, "rank")] = None,
    world_size: Annotated[int | None, _opt(ExtractConfig, "world_size")] = None,
    device: Annotated[str | None, _opt(ExtractConfig, "device")] = None,
    topk_chunk: Annotated[int | None, _opt(ExtractConfig, "topk_chunk")] = None,
    tensor_parallel_size: Annotated[int | None, _opt(ExtractConfig, "tensor_parallel_size")] = None,
    gpu_memory_utilization: Annotated[float | None, _opt(ExtractConfig, "gpu_memory_utilization")] = None,
    max_num_batched_tokens: Annotated[int | None, _opt(ExtractConfig, "max_num_batched_tokens")] = None,
    allow_other_target: Annotated[bool | None, _opt(ExtractConfig, "allow_other_target")] = None,
) -> None:
    """Run the target model once over chat data and write (or resume) a cache."""
    cfg = resolve(ExtractConfig, config, _overrides(locals()))
    from peagle_pipeline.stages.extract import stage

    summary = stage.run(cfg)
    if summary is not None:
        typer.echo(summary.format())


@app.command()
def train(
    config: ConfigOpt = None,
    cache: Annotated[str | None, _opt(TrainConfig, "cache")] = None,
    extra_cache: Annotated[list[str] | None, _opt(TrainConfig, "extra_cache")] = None,
    output: Annotated[str | None, _opt(TrainConfig, "output")] = None,
    draft_layers: Annotated[int | None, _opt(TrainConfig, "draft_layers")] = None,
    depths: Annotated[int | None, _opt(TrainConfig, "depths")] = None,
    draft_vocab_size: Annotated[int | None, _opt(TrainConfig, "draft_vocab_size")] = None,
    tokens_per_step: Annotated[int | None, _opt(TrainConfig, "tokens_per_step")] = None,
    epochs: Annotated[int | None, _opt(TrainConfig, "epochs")] = None,
    steps: Annotated[int | None, _opt(TrainConfig, "steps")] = None,
    lr: Annotated[float | None, _opt(TrainConfig, "lr")] = None,
    warmup: Annotated[int | None, _opt(TrainConfig, "warmup")] = None,
    schedule: Annotated[str | None, _opt(TrainConfig, "schedule")] = None,
    weight_decay: Annotated[float | None, _opt(TrainConfig, "weight_decay")] = None,
    grad_clip: Annotated[float | None, _opt(TrainConfig, "grad_clip")] = None,
    down_sample_ratio: Annotated[float | None, _opt(TrainConfig, "down_sample_ratio")] = None,
    down_sample_ratio_min: Annotated[float | None, _opt(TrainConfig, "down_sample_ratio_min")] = None,
    max_anchors: Annotated[int | None, _opt(TrainConfig, "max_anchors")] = None,
    sequence_partitions: Annotated[int | None, _opt(TrainConfig, "sequence_partitions")] = None,
    grad_checkpointing: Annotated[
        bool | None,
        _opt(TrainConfig, "grad_checkpointing"),
    ] = None,
    target: Annotated[str | None, _opt(TrainConfig, "target")] = None,
    loss_positions: Annotated[str | None, _opt(TrainConfig, "loss_positions")] = None,
    eval_samples: Annotated[int | None, _opt(TrainConfig, "eval_samples")] = None,
    eval_cache: Annotated[str | None, _opt(TrainConfig, "eval_cache")] = None,
    eval_every: Annotated[int | None, _opt(TrainConfig, "eval_every")] = None,
    seed: Annotated[int | None, _opt(TrainConfig, "seed")] = None,
    save_every: Annotated[int | None, _opt(TrainConfig, "save_every")] = None,
    keep_checkpoints: Annotated[int | None, _opt(TrainConfig, "keep_checkpoints")] = None,
    precision: Annotated[str | None, _opt(TrainConfig, "precision")] = None,
    device: Annotated[str | None, _opt(TrainConfig, "device")] = None,
    fsdp: Annotated[bool | None, _opt(TrainConfig, "fsdp")] = None,
    resume: Annotated[bool | None, _opt(TrainConfig, "resume")] = None,
    num_workers: Annotated[int | None, _opt(TrainConfig, "num_workers")] = None,
    loss_chunk: Annotated[int | None, _opt(TrainConfig, "loss_chunk")] = None,
    norm_before_residual: Annotated[
        bool | None,
        _opt(TrainConfig, "norm_before_residual"),
    ] = None,
    init_from_target: Annotated[bool | None, _opt(TrainConfig, "init_from_target")] = None,
    mask_token_id: Annotated[int | None, _opt(TrainConfig, "mask_token_id")] = None,
    skip_corrupt: Annotated[bool | None, _opt(TrainConfig, "skip_corrupt")] = None,
    max_bad_steps: Annotated[int | None, _opt(TrainConfig, "max_bad_steps")] = None,
    log_every: Annotated[int | None, _opt(TrainConfig, "log_every")] = None,
    export: Annotated[bool | None, _opt(TrainConfig, "export")] = None,
) -> None:
    """Train a P-EAGLE draft from a cache (never loads the target model)."""
    cfg = resolve(TrainConfig, config, _overrides(locals()))
    from peagle_pipeline.stages.train import stage

    stage.run(cfg)


@app.command()
def inspect(
    cache: Annotated[str, typer.Argument(metavar="CACHE", help="Cache directory.")],
    sample: Annotated[int | None, typer.Option(help="Show this sample's tokens as a table.")] = None,
    rows: Annotated[int, typer.Option(help="Rows of the --sample table to show (0 = all).")] = 60,
) -> None:
    """Print a cache's settings and statistics, or one sample's tokens."""
    from peagle_pipeline.cache.reader import open_cache

    c = open_cache(cache)
    typer.echo(c.describe_sample(sample, rows=rows) if sample is not None else c.summary())


@app.command()
def verify(cache: Annotated[str, typer.Argument(metavar="CACHE", help="Cache directory.")]) -> None:
    """Read every store back and report any inconsistency by store and sample (exit 4 if any; 3 if incomplete;
    12 if an object store does not answer)."""
    from peagle_pipeline.cache.verify import verify_path
    from peagle_pipeline.errors import CorruptCache, IncompatibleCache

    problems = verify_path(cache)
    for line in problems:
        typer.echo(line)
    damage = [p for p in problems if getattr(p, "kind", "damage") == "damage"]
    if damage:
        raise CorruptCache(f"{len(damage)} problem(s) found in {cache}")
    if problems:  # stores being written or never finished: what they commit is sound
        raise IncompatibleCache(
            f"{cache} is incomplete ({len(problems)} store(s) still being written or never finished); "
            "what is committed verified ok"
        )
    typer.echo(f"ok: {cache} verified")


@app.command()
def export(
    run_dir: Annotated[str, typer.Argument(metavar="RUN", help="Training run directory.")],
    output: Annotated[
        str, typer.Option(metavar="DIR", help="Export directory (speculators P-EAGLE format).")
    ],
    checkpoint: Annotated[
        str, typer.Option(metavar="[best|latest|step-N]", help="Which checkpoint to export.")
    ] = "best",
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Replace another run's export in --output (other files there are never replaced)."
        ),
    ] = False,
    speculative_tokens: Annotated[
        int | None,
        typer.Option(
            metavar="K",
            help=f"K vLLM drafts by default (config.json speculative_tokens), at most the trained --depths "
            f"(default: {SERVING_DEPTHS}, or the trained depths when fewer).",
        ),
    ] = None,
) -> None:
    """Export a trained draft in the speculators P-EAGLE format that vLLM loads."""
    from peagle_pipeline.stages.export import stage

    path = stage.export_run(
        run_dir, output, checkpoint=checkpoint, force=force, speculative_tokens=speculative_tokens
    )
    typer.echo(f"exported to {path}")


@app.command()
def plot(run_dir: Annotated[str, typer.Argument(metavar="RUN", help="Training run directory.")]) -> None:
    """Write PNG curves (loss, per-depth agreement, acceptance length) from metrics.jsonl."""
    from peagle_pipeline.stages.train import metrics

    for path in metrics.plot(run_dir):
        typer.echo(f"wrote {path}")


@app.command()
def evaluate(
    drafts: Annotated[list[str], _opt(EvaluateConfig, "drafts")],
    target: Annotated[str | None, _opt(EvaluateConfig, "target")] = None,
    prompts: Annotated[list[str] | None, _opt(EvaluateConfig, "prompts")] = None,
    num_prompts: Annotated[int | None, _opt(EvaluateConfig, "num_prompts")] = None,
    max_tokens: Annotated[int | None, _opt(EvaluateConfig, "max_tokens")] = None,
    temperature: Annotated[float | None, _opt(EvaluateConfig, "temperature")] = None,
    depths: Annotated[int | None, _opt(EvaluateConfig, "depths")] = None,
    concurrency: Annotated[list[int] | None, _opt(EvaluateConfig, "concurrency")] = None,
    acceptance_concurrency: Annotated[int | None, _opt(EvaluateConfig, "acceptance_concurrency")] = None,
    output: Annotated[str | None, _opt(EvaluateConfig, "output")] = None,
    dtype: Annotated[str | None, _opt(EvaluateConfig, "dtype")] = None,
    seed: Annotated[int | None, _opt(EvaluateConfig, "seed")] = None,
    chat_template_kwargs: Annotated[str | None, _opt(EvaluateConfig, "chat_template_kwargs")] = None,
    tensor_parallel_size: Annotated[int | None, _opt(EvaluateConfig, "tensor_parallel_size")] = None,
    gpu_memory_utilization: Annotated[float | None, _opt(EvaluateConfig, "gpu_memory_utilization")] = None,
    allow_other_target: Annotated[bool | None, _opt(EvaluateConfig, "allow_other_target")] = None,
) -> None:
    """Measure drafts in vLLM: acceptance length, per-position acceptance, tokens/s and speedup per prompt set."""
    cfg = EvaluateConfig(**_given(locals()))
    from peagle_pipeline.stages.evaluate import stage

    stage.run(cfg, echo=typer.echo)


@app.command("vllm-check")
def vllm_check(
    draft: Annotated[str, _opt(VllmCheckConfig, "draft")],
    target: Annotated[str, _opt(VllmCheckConfig, "target")],
    prompts: Annotated[str | None, _opt(VllmCheckConfig, "prompts")] = None,
    num_prompts: Annotated[int | None, _opt(VllmCheckConfig, "num_prompts")] = None,
    max_tokens: Annotated[int | None, _opt(VllmCheckConfig, "max_tokens")] = None,
    depths: Annotated[int | None, _opt(VllmCheckConfig, "depths")] = None,
    report: Annotated[str | None, _opt(VllmCheckConfig, "report")] = None,
    tensor_parallel_size: Annotated[int | None, _opt(VllmCheckConfig, "tensor_parallel_size")] = None,
    gpu_memory_utilization: Annotated[float | None, _opt(VllmCheckConfig, "gpu_memory_utilization")] = None,
    dtype: Annotated[str | None, _opt(VllmCheckConfig, "dtype")] = None,
    allow_other_target: Annotated[bool | None, _opt(VllmCheckConfig, "allow_other_target")] = None,
) -> None:
    """Load target + draft in vLLM (parallel drafting), check greedy equality, report vLLM's acceptance."""
    given = _given(locals())
    from peagle_pipeline.stages.evaluate import vllm_check as stage

    stage.run(echo=typer.echo, **given)


# A stop the stage did not report itself came before its work began (imports, loading the model, starting a
# backend): from their first commit on, the stages' own handlers report stops, with what they committed.
_STOPPED = (
    " before this command committed any work (what earlier runs committed is kept); re-run the same command"
)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns (and exits with) the process exit code."""
    debug = os.environ.get("PEAGLE_DEBUG") == "1"
    skip_final_collection()  # seconds less at exit, once the command is done (process_exit.py)
    preemption.install()  # SIGTERM (preemption) stops a command the way Ctrl-C does; exit 143
    drop_shipped_config_notices()
    try:
        # standalone_mode=False: typer returns the code of an Exit (and 130 for a Ctrl-C it caught) instead of
        # exiting, and lets PeagleError and click's usage errors through to the handlers below.
        returned = app(args=argv, prog_name="peagle-pipeline", standalone_mode=False)
        code = returned if isinstance(returned, int) else 0
        if code == Interrupted.exit_code:  # typer's code for a stop (SIGINT or SIGTERM) it caught
            code = _report(preemption.stop_error(preemption.last_stop_signal(), _STOPPED))
    except PeagleError as err:
        if debug:
            raise
        code = _report(err)
    except KeyboardInterrupt as stop:
        if debug:
            raise
        code = _report(preemption.stop_error(stop, _STOPPED))
    except (
        OSError
    ) as err:  # a path that cannot be used: disk full, read-only, missing, a file for a directory
        mapped = from_os_error(err)
        if debug or mapped is None:
            raise
        code = _report(mapped)
    except Exception as err:  # typer vendors click: match its usage errors by shape, not by import
        if debug or not (hasattr(err, "show") and hasattr(err, "exit_code")):
            if type(err).__name__ == "Exit":
                code = int(getattr(err, "exit_code", 0))
            elif type(err).__name__ == "Abort":  # click's wrapper of a KeyboardInterrupt it caught
                code = _report(preemption.stop_error(err, _STOPPED))
            else:
                raise
        else:
            err.show()
            code = int(err.exit_code)
    if argv is None:
        sys.exit(code)
    return code


def _report(err: PeagleError) -> int:
    """Print the one error line; returns the exit code. After a stop (Ctrl-C, or an object store that went away
    mid-upload), asyncio's complaints about the tasks it abandoned (Zarr's and aiohttp's I/O: "Task exception was
    never retrieved" with a traceback per request) would follow at exit: silence them, the line above says what
    happened. PEAGLE_DEBUG=1 raises instead of reporting, so they still show there."""
    line = _torchrun_voice(err)
    if line is not None:
        print(line, file=sys.stderr)
    logging.getLogger("asyncio").disabled = True
    return err.exit_code


# Errors every rank of a torchrun job meets alike (the same settings, files and signals): rank 0 alone reports them.
_SHARED = (BadInput, ResumeMismatch, OutputExists, IncompatibleCache, Busy, Interrupted, RankLost)


def _torchrun_voice(err: PeagleError) -> str | None:
    """The error line of this process (None: say nothing). Under torchrun (WORLD_SIZE > 1) rank 0 speaks for the
    run, and says that torchrun itself exits 1 whatever the code; another rank speaks only of its own failure,
    naming its rank."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1") or 1), int(os.environ.get("RANK", "0") or 0)
    if world <= 1 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return f"error: {err}"
    if rank != 0:
        return None if isinstance(err, _SHARED) else f"error: rank {rank}: {err}"
    return f"error: {err} (exit {err.exit_code}; torchrun itself exits 1 and lists each rank's exit code)"


if __name__ == "__main__":
    main()
