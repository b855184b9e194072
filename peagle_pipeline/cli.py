"""The `peagle-pipeline` command line: parse flags, resolve the config, call a stage. Nothing else.

`main()` is the one error boundary: a `PeagleError` becomes one line on stderr and its exit code;
set PEAGLE_DEBUG=1 to see the traceback instead. Heavy imports (torch, zarr) happen inside commands.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from peagle_pipeline.config import ExtractConfig, GenerateConfig, TrainConfig, describe_fields, resolve
from peagle_pipeline.errors import Interrupted, PeagleError

__all__ = ["app", "main"]

app = typer.Typer(
    name="peagle-pipeline",
    help="Regenerate chat data with the target, extract its hidden states into a Zarr cache, then train "
    "P-EAGLE drafts for vLLM from it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_GENERATE_HELP = {name: help for name, help, _ in describe_fields(GenerateConfig)}
_EXTRACT_HELP = {name: help for name, help, _ in describe_fields(ExtractConfig)}
_TRAIN_HELP = {name: help for name, help, _ in describe_fields(TrainConfig)}


def _G(name: str) -> str:
    return _GENERATE_HELP[name]


def _E(name: str) -> str:
    return _EXTRACT_HELP[name]


def _T(name: str) -> str:
    return _TRAIN_HELP[name]


ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="Pipeline file (YAML); flags override its section.")
]


def _overrides(local: dict[str, Any]) -> dict[str, Any]:
    """The flags the user actually gave (typer passes None for the rest)."""
    return {k: v for k, v in local.items() if k != "config" and v is not None}


@app.command()
def generate(
    config: ConfigOpt = None,
    model: Annotated[str | None, typer.Option(help=_G("model"))] = None,
    data: Annotated[list[str] | None, typer.Option(help=_G("data"))] = None,
    output: Annotated[str | None, typer.Option(help=_G("output"))] = None,
    backend: Annotated[str | None, typer.Option(help=_G("backend"))] = None,
    turns: Annotated[str | None, typer.Option(help=_G("turns"))] = None,
    temperature: Annotated[float | None, typer.Option(help=_G("temperature"))] = None,
    top_p: Annotated[float | None, typer.Option(help=_G("top_p"))] = None,
    repetition_penalty: Annotated[float | None, typer.Option(help=_G("repetition_penalty"))] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help=_G("max_new_tokens"))] = None,
    max_prompt_tokens: Annotated[int | None, typer.Option(help=_G("max_prompt_tokens"))] = None,
    samples_per_prompt: Annotated[int | None, typer.Option(help=_G("samples_per_prompt"))] = None,
    seed: Annotated[int | None, typer.Option(help=_G("seed"))] = None,
    max_samples: Annotated[int | None, typer.Option(help=_G("max_samples"))] = None,
    chunk_size: Annotated[int | None, typer.Option(help=_G("chunk_size"))] = None,
    batch_size: Annotated[int | None, typer.Option(help=_G("batch_size"))] = None,
    rank: Annotated[int | None, typer.Option(help=_G("rank"))] = None,
    world_size: Annotated[int | None, typer.Option(help=_G("world_size"))] = None,
    device: Annotated[str | None, typer.Option(help=_G("device"))] = None,
    compute_dtype: Annotated[str | None, typer.Option(help=_G("compute_dtype"))] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(help=_G("tensor_parallel_size"))] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help=_G("gpu_memory_utilization"))] = None,
) -> None:
    """Regenerate the assistant replies of chat data with the target (on-policy rows that extract reads)."""
    cfg = resolve(GenerateConfig, config, _overrides(locals()))
    from peagle_pipeline.stages import generate as stage

    summary = stage.run(cfg, echo=lambda line: typer.echo(line, err=True))
    typer.echo(summary.format())


@app.command()
def extract(
    config: ConfigOpt = None,
    model: Annotated[str | None, typer.Option(help=_E("model"))] = None,
    data: Annotated[list[str] | None, typer.Option(help=_E("data"))] = None,
    output: Annotated[str | None, typer.Option(help=_E("output"))] = None,
    backend: Annotated[str | None, typer.Option(help=_E("backend"))] = None,
    layers: Annotated[str | None, typer.Option(help=_E("layers"))] = None,
    topk: Annotated[int | None, typer.Option(help=_E("topk"))] = None,
    last_hidden: Annotated[
        bool | None, typer.Option("--last-hidden/--no-last-hidden", help=_E("last_hidden"))
    ] = None,
    max_length: Annotated[int | None, typer.Option(help=_E("max_length"))] = None,
    overlong: Annotated[str | None, typer.Option(help=_E("overlong"))] = None,
    max_samples: Annotated[int | None, typer.Option(help=_E("max_samples"))] = None,
    batch_tokens: Annotated[int | None, typer.Option(help=_E("batch_tokens"))] = None,
    dtype: Annotated[str | None, typer.Option(help=_E("dtype"))] = None,
    assistant_turns: Annotated[str | None, typer.Option(help=_E("assistant_turns"))] = None,
    leading_assistant: Annotated[str | None, typer.Option(help=_E("leading_assistant"))] = None,
    compress: Annotated[str | None, typer.Option(help=_E("compress"))] = None,
    shard_tokens: Annotated[int | None, typer.Option(help=_E("shard_tokens"))] = None,
    chunk_tokens: Annotated[int | None, typer.Option(help=_E("chunk_tokens"))] = None,
    rank: Annotated[int | None, typer.Option(help=_E("rank"))] = None,
    world_size: Annotated[int | None, typer.Option(help=_E("world_size"))] = None,
    device: Annotated[str | None, typer.Option(help=_E("device"))] = None,
    topk_chunk: Annotated[int | None, typer.Option(help=_E("topk_chunk"))] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(help=_E("tensor_parallel_size"))] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help=_E("gpu_memory_utilization"))] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help=_E("max_num_batched_tokens"))] = None,
) -> None:
    """Run the target model once over chat data and write (or resume) a cache."""
    cfg = resolve(ExtractConfig, config, _overrides(locals()))
    from peagle_pipeline.stages import extract as stage

    summary = stage.run(cfg)
    if summary is not None:
        typer.echo(summary.format())


@app.command()
def train(
    config: ConfigOpt = None,
    cache: Annotated[str | None, typer.Option(help=_T("cache"))] = None,
    output: Annotated[str | None, typer.Option(help=_T("output"))] = None,
    draft_layers: Annotated[int | None, typer.Option(help=_T("draft_layers"))] = None,
    depths: Annotated[int | None, typer.Option(help=_T("depths"))] = None,
    draft_vocab_size: Annotated[int | None, typer.Option(help=_T("draft_vocab_size"))] = None,
    tokens_per_step: Annotated[int | None, typer.Option(help=_T("tokens_per_step"))] = None,
    epochs: Annotated[int | None, typer.Option(help=_T("epochs"))] = None,
    steps: Annotated[int | None, typer.Option(help=_T("steps"))] = None,
    lr: Annotated[float | None, typer.Option(help=_T("lr"))] = None,
    warmup: Annotated[int | None, typer.Option(help=_T("warmup"))] = None,
    schedule: Annotated[str | None, typer.Option(help=_T("schedule"))] = None,
    weight_decay: Annotated[float | None, typer.Option(help=_T("weight_decay"))] = None,
    grad_clip: Annotated[float | None, typer.Option(help=_T("grad_clip"))] = None,
    down_sample_ratio: Annotated[float | None, typer.Option(help=_T("down_sample_ratio"))] = None,
    down_sample_ratio_min: Annotated[float | None, typer.Option(help=_T("down_sample_ratio_min"))] = None,
    max_anchors: Annotated[int | None, typer.Option(help=_T("max_anchors"))] = None,
    sequence_partitions: Annotated[int | None, typer.Option(help=_T("sequence_partitions"))] = None,
    grad_checkpointing: Annotated[
        bool | None,
        typer.Option("--grad-checkpointing/--no-grad-checkpointing", help=_T("grad_checkpointing")),
    ] = None,
    target: Annotated[str | None, typer.Option(help=_T("target"))] = None,
    eval_samples: Annotated[int | None, typer.Option(help=_T("eval_samples"))] = None,
    eval_every: Annotated[int | None, typer.Option(help=_T("eval_every"))] = None,
    seed: Annotated[int | None, typer.Option(help=_T("seed"))] = None,
    save_every: Annotated[int | None, typer.Option(help=_T("save_every"))] = None,
    keep_checkpoints: Annotated[int | None, typer.Option(help=_T("keep_checkpoints"))] = None,
    precision: Annotated[str | None, typer.Option(help=_T("precision"))] = None,
    device: Annotated[str | None, typer.Option(help=_T("device"))] = None,
    resume: Annotated[bool | None, typer.Option("--resume/--no-resume", help=_T("resume"))] = None,
    num_workers: Annotated[int | None, typer.Option(help=_T("num_workers"))] = None,
    loss_chunk: Annotated[int | None, typer.Option(help=_T("loss_chunk"))] = None,
    norm_before_residual: Annotated[
        bool | None,
        typer.Option("--norm-before-residual/--no-norm-before-residual", help=_T("norm_before_residual")),
    ] = None,
    skip_corrupt: Annotated[
        bool | None, typer.Option("--skip-corrupt/--no-skip-corrupt", help=_T("skip_corrupt"))
    ] = None,
    max_bad_steps: Annotated[int | None, typer.Option(help=_T("max_bad_steps"))] = None,
    log_every: Annotated[int | None, typer.Option(help=_T("log_every"))] = None,
    export: Annotated[bool | None, typer.Option("--export/--no-export", help=_T("export"))] = None,
) -> None:
    """Train a P-EAGLE draft from a cache (never loads the target model)."""
    cfg = resolve(TrainConfig, config, _overrides(locals()))
    from peagle_pipeline.stages import train as stage

    stage.run(cfg)


@app.command()
def inspect(
    cache: Annotated[str, typer.Argument(help="Cache directory.")],
    sample: Annotated[int | None, typer.Option(help="Show this sample's tokens as a table.")] = None,
    rows: Annotated[int, typer.Option(help="Rows of the --sample table to show (0 = all).")] = 60,
) -> None:
    """Print a cache's settings and statistics, or one sample's tokens."""
    from peagle_pipeline.cache.reader import open_cache

    c = open_cache(cache)
    typer.echo(c.describe_sample(sample, rows=rows) if sample is not None else c.summary())


@app.command()
def verify(cache: Annotated[str, typer.Argument(help="Cache directory.")]) -> None:
    """Read every store back and report any inconsistency by store and sample (exit 4 if any)."""
    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.errors import CorruptCache

    problems = open_cache(cache, check=False).verify()
    for line in problems:
        typer.echo(line)
    if problems:
        raise CorruptCache(f"{len(problems)} problem(s) found in {cache}")
    typer.echo(f"ok: {cache} verified")


@app.command()
def export(
    run_dir: Annotated[str, typer.Argument(help="Training run directory.")],
    output: Annotated[str, typer.Option(help="Export directory (speculators P-EAGLE format).")],
    checkpoint: Annotated[str, typer.Option(help="latest, best, or step-N.")] = "best",
) -> None:
    """Export a trained draft in the speculators P-EAGLE format that vLLM loads."""
    from peagle_pipeline.stages import export as stage

    path = stage.export_run(run_dir, output, checkpoint=checkpoint)
    typer.echo(f"exported to {path}")


@app.command()
def plot(run_dir: Annotated[str, typer.Argument(help="Training run directory.")]) -> None:
    """Write PNG curves (loss, per-depth agreement, acceptance length) from metrics.jsonl."""
    from peagle_pipeline.stages import metrics

    for path in metrics.plot(run_dir):
        typer.echo(f"wrote {path}")


@app.command("vllm-check")
def vllm_check(
    draft_dir: Annotated[str, typer.Argument(help="Exported draft directory.")],
    target: Annotated[str, typer.Option(help="Target model directory.")],
    prompts: Annotated[
        str | None,
        typer.Option(
            help="Prompt file (JSONL with 'prompt' or chat data), or a cache dir for held-out prompts."
        ),
    ] = None,
    num_prompts: Annotated[int, typer.Option(help="Prompts to generate for.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 64,
    depths: Annotated[
        int | None, typer.Option(help="num_speculative_tokens (default: the draft's K).")
    ] = None,
    report: Annotated[
        str | None, typer.Option(help="Write the JSON report (acceptance, mismatches) here.")
    ] = None,
    tensor_parallel_size: Annotated[int, typer.Option(help="vLLM tensor parallel size.")] = 1,
) -> None:
    """Load target + draft in vLLM (parallel drafting), check greedy equality, report vLLM's acceptance."""
    from peagle_pipeline.stages import vllm_check as stage

    stage.run(
        draft_dir,
        target,
        prompts=prompts,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        depths=depths,
        report=report,
        tensor_parallel_size=tensor_parallel_size,
        echo=typer.echo,
    )


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns (and exits with) the process exit code."""
    debug = os.environ.get("PEAGLE_DEBUG") == "1"
    try:
        app(args=argv, standalone_mode=False)
        code = 0
    except PeagleError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        code = err.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print(
            f"error: {Interrupted('interrupted: committed work is kept; re-run the same command to resume')}",
            file=sys.stderr,
        )
        code = Interrupted.exit_code
    except Exception as err:  # typer vendors click: match its usage errors by shape, not by import
        if debug or not (hasattr(err, "show") and hasattr(err, "exit_code")):
            if type(err).__name__ == "Exit":
                code = int(getattr(err, "exit_code", 0))
            elif type(err).__name__ == "Abort":
                print("error: interrupted", file=sys.stderr)
                code = Interrupted.exit_code
            else:
                raise
        else:
            err.show()
            code = int(err.exit_code)
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
