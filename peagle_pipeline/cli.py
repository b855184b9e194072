"""The `peagle-pipeline` command line: parse flags, resolve the config, call a stage. Nothing else.

`main()` is the one error boundary: a `PeagleError` becomes one line on stderr and its exit code, Ctrl-C exit 130, SIGTERM 143,
an OS error about a path (disk full, read-only, missing) its `errors.from_os_error` class; set PEAGLE_DEBUG=1 to see
the traceback instead. Heavy imports (torch, zarr) happen inside commands, so `--help`, `--version` and `plot`
start without torch. The options of generate, extract, train, evaluate and vllm-check are the fields of their config
dataclasses (`cli_options.config_command`): a setting is declared once, in config/. The few options that are no
setting are the commands' modes (`extract --plan`, `train --nproc-per-node N`), declared here.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from peagle_pipeline import preemption
from peagle_pipeline.cli_options import config_command
from peagle_pipeline.config import (
    SERVING_DEPTHS,
    EvaluateConfig,
    ExtractConfig,
    GenerateConfig,
    TrainConfig,
    VllmCheckConfig,
)
from peagle_pipeline.errors import (
    BadInput,
    Busy,
    IncompatibleCache,
    Interrupted,
    OutputExists,
    PeagleError,
    RankLost,
    Reported,
    ResumeMismatch,
    from_os_error,
)
from peagle_pipeline.process_exit import skip_final_collection
from peagle_pipeline.runtime import LAUNCHER_ENV, drop_shipped_config_notices

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


@config_command(app, GenerateConfig)
def generate(cfg: GenerateConfig) -> None:
    """Regenerate the assistant replies of chat data with the target (on-policy rows that extract reads)."""
    from peagle_pipeline.stages.generate import stage

    summary = stage.run(cfg, echo=lambda line: typer.echo(line, err=True))
    typer.echo(summary.format())


@config_command(
    app,
    ExtractConfig,
    modes={"plan": "Print the estimated cache size and the free space, then exit (no weights loaded)."},
)
def extract(cfg: ExtractConfig, plan: bool = False) -> None:
    """Run the target model once over chat data and write (or resume) a cache."""
    from peagle_pipeline.stages.extract import stage

    if plan:
        typer.echo(stage.plan(cfg))
        return
    summary = stage.run(cfg)
    if summary is not None:
        typer.echo(summary.format())


_NPROC_HELP = (
    "Start N ranks of this train command on this machine (DDP, or FSDP with --fsdp), as `torchrun --standalone "
    "--nproc-per-node N` does, and exit with the run's own exit code (torchrun exits 1); several machines: "
    "torchrun. Not a setting: no pipeline-file key."
)


@config_command(app, TrainConfig, modes={"nproc_per_node": (int, "N", _NPROC_HELP)})
def train(cfg: TrainConfig, ctx: typer.Context, nproc_per_node: int | None = None) -> None:
    """Train a P-EAGLE draft from a cache (never loads the target model)."""
    if nproc_per_node is not None:
        from peagle_pipeline.stages.train import launch

        launch.run(cfg, nproc_per_node, ctx.obj)
        return
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


@config_command(app, EvaluateConfig)
def evaluate(**given: Any) -> None:
    """Measure drafts in vLLM: acceptance length, per-position acceptance, tokens/s and speedup per prompt set."""
    from peagle_pipeline.stages.evaluate import stage

    stage.run(EvaluateConfig(**given), echo=typer.echo)


@config_command(app, VllmCheckConfig, "vllm-check")
def vllm_check(**given: Any) -> None:
    """Load target + draft in vLLM (parallel drafting), check greedy equality, report vLLM's acceptance."""
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
        # obj: the command line, for a command that starts itself again (`train --nproc-per-node N`)
        args = sys.argv[1:] if argv is None else list(argv)
        returned = app(args=args, prog_name="peagle-pipeline", standalone_mode=False, obj=args)
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
    naming its rank. Under `train --nproc-per-node N` the launcher exits with rank 0's code and says itself which
    rank died, so rank 0 says nothing of a lost rank; the launcher does not repeat a failure a rank reported."""
    if isinstance(err, Reported):
        return None
    world, rank = int(os.environ.get("WORLD_SIZE", "1") or 1), int(os.environ.get("RANK", "0") or 0)
    launched = os.environ.get(LAUNCHER_ENV) == "1"
    if world <= 1 or not (launched or "TORCHELASTIC_RUN_ID" in os.environ):
        return f"error: {err}"
    if rank != 0:
        return None if isinstance(err, _SHARED) else f"error: rank {rank}: {err}"
    if launched:
        return None if isinstance(err, RankLost) else f"error: {err}"
    return f"error: {err} (exit {err.exit_code}; torchrun itself exits 1 and lists each rank's exit code)"


if __name__ == "__main__":
    main()
