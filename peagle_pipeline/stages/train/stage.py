"""`peagle-pipeline train`: train a P-EAGLE draft from a cache (never loads the target model).

`run()` is the stage: it locks and checks the run folder, builds the `stages.trainer.Trainer` (every check
before anything is written), writes the run files, runs the loop under Ctrl-C/SIGTERM handling and finishes
with the plots, the export and the held-out summary. The step itself is described in `stages.trainer`.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from peagle_pipeline.config import TrainConfig, to_dict
from peagle_pipeline.errors import BadInput, OutOfSpace, RankLost, ResumeMismatch, from_os_error
from peagle_pipeline.hardware import describe_compute_dtype, usable_cpus
from peagle_pipeline.preemption import StopRequest, stop_error
from peagle_pipeline.runtime import RankLock, configure_logging
from peagle_pipeline.stages.export.stage import check_export_target, export_run
from peagle_pipeline.stages.run_layout import RUN_JSON
from peagle_pipeline.stages.run_records import run_identity
from peagle_pipeline.stages.train import metrics as metrics_mod
from peagle_pipeline.stages.train.distributed import Dist, lost_peer, rank_lost
from peagle_pipeline.stages.train.draft import describe_mask_token, describe_vocab_coverage
from peagle_pipeline.stages.train.metrics import format_figure
from peagle_pipeline.stages.train.optim import effective_warmup, lr_at
from peagle_pipeline.stages.train.rundir import (
    EXPORT_DIR,
    LOCK_FILE,
    check_output_path,
    global_batch_tokens,
    prepare_output,
    write_run_files,
)
from peagle_pipeline.stages.train.trackers import TrackerRun, check_installed, open_trackers
from peagle_pipeline.stages.train.trainer import Trainer

__all__ = ["run", "Trainer"]

log = logging.getLogger(__name__)


STOP_NOTICE = "stopping after this step and saving a checkpoint (a second Ctrl-C or SIGTERM stops at once)"


def _stop_notice(dist: Dist) -> str:
    """What a stop signal prints at once: rank 0 speaks for the run (the other ranks' notice is empty); under
    torchrun the checkpoint is promised only if every rank is still there (a signal from torchrun often means one
    died)."""
    if not dist.main:
        return ""
    if dist.world == 1:
        return STOP_NOTICE
    return STOP_NOTICE.replace("saving a checkpoint", "saving a checkpoint if every rank is still running")


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) a run; returns the final held-out metrics.

    Order: lock the run folder, check it, build every component (all the checks), only then write the run files,
    so a failed start blocks no retry. Ctrl-C or SIGTERM stops at the next step boundary with a checkpoint (exit
    130, 143). Raises a PeagleError for every user mistake (`prepare_output`, `build_draft`, the cache reader).
    """
    dist = Dist.setup(cfg.device)
    configure_logging(logging.INFO if dist.main else logging.WARNING)
    out = Path(cfg.output)
    lock, created, lock_created, started = None, False, False, False
    sink: Any = metrics_mod.NullSink()
    try:
        if dist.main:
            lock, created, lock_created = _lock_run(cfg)
        dist.barrier()
        resumed = prepare_output(cfg, dist.world)  # every rank checks before anyone writes
        if cfg.export and resumed:  # refuse an export folder holding the user's files now, not after training
            check_export_target(Path(cfg.output) / EXPORT_DIR, run_identity(cfg.output), own=True)
        trainer = Trainer(cfg, dist)
        if resumed and trainer.restore():
            _check_extension(cfg, trainer)
        dist.barrier()
        if dist.main:
            if lock is not None:
                lock.write_pid()
            write_run_files(cfg, dist.world, resumed, trainer.total_steps)
            trainer.spec.save(cfg.output)
        started = True
        if dist.main:
            sink = trainer.sink = _open_sink(cfg, trainer)
            _write_start_notes(cfg, trainer, dist, sink)
        with StopRequest(
            _stop_notice(dist)
        ) as stop:  # Ctrl-C/SIGTERM from here on: finish the step, save, stop
            final = trainer.fit(should_stop=lambda: stop.signum)
        if dist.main:
            _finish(cfg, final, sink)
        sink.close()
        dist.barrier()
        return final
    except (OutOfSpace, OSError, RuntimeError) as err:  # disk full; under torchrun, a rank that died
        raise _explained(err, cfg, dist) from None
    except KeyboardInterrupt as stop:  # a stop before the loop, or a second one inside it: no saving
        raise stop_error(
            stop,
            ": the last complete checkpoint is kept; re-run with --resume to continue"
            if started
            else " before training started; re-run the same command to start",
        ) from None
    finally:
        sink.close()
        if lock is not None:
            if not started:
                _forget_start(out, lock, created, lock_created)
            lock.release()
        dist.teardown()


def _explained(err: Exception, cfg: TrainConfig, dist: Dist) -> Exception:
    """The one-line error for a full disk (naming --resume where it is needed) or for a collective that failed
    because another rank died; anything else is raised as it is."""
    if isinstance(err, RuntimeError):
        if dist.world == 1 or not lost_peer(err):
            raise err
        return _rank_lost(cfg, dist)
    return _with_resume(err, Path(cfg.output))  # type: ignore[arg-type]  # OutOfSpace or OSError


def _rank_lost(cfg: TrainConfig, dist: Dist) -> RankLost:
    """The one line for a run that lost a rank: which one, the last complete checkpoint, the resume command (under
    `train --nproc-per-node` the launcher says it, naming the rank and how it ended)."""
    who = f"rank {1 - dist.rank}" if dist.world == 2 else "another rank"
    how = "died (its process ended; torchrun names it)"
    return rank_lost(cfg.output, who, dist.world, how, "torchrun command")


def _with_resume(err: OutOfSpace | OSError, out: Path) -> OutOfSpace:
    """A disk-full error whose advice names `--resume` when the run folder records a run (run.json): re-running
    the same command without it is refused there. Any other OS error is raised as it is."""
    mapped = from_os_error(err) if isinstance(err, OSError) else err
    if not isinstance(mapped, OutOfSpace):
        raise err
    err, same = mapped, "re-run the same command to resume"
    if (out / RUN_JSON).exists() and same in str(err):
        return OutOfSpace(
            str(err).replace(same, "re-run it with --resume to continue from the last complete checkpoint")
        )
    return err


def _lock_run(cfg: TrainConfig) -> tuple[RankLock, bool, bool]:
    """Check the run folder's path and lock it (rank 0): (the lock, whether the folder and the lock file were
    made by this start)."""
    out = Path(cfg.output)
    check_output_path(cfg.output)
    check_installed(cfg.trackers())  # a tracker asked for but not installed: one line, nothing written
    created, lock_created = not out.exists(), not (out / LOCK_FILE).exists()
    lock = RankLock(
        out / LOCK_FILE,
        f"training run {cfg.output}",
        "wait for it or stop it, or choose another --output",
    ).acquire(write_pid=False)  # a start refused by the checks below leaves the folder as it was
    return lock, created, lock_created


def _open_sink(cfg: TrainConfig, trainer: Trainer) -> metrics_mod.RunSink:
    """The run's metrics sink (rank 0): metrics.jsonl, progress and the experiment trackers, which are told the
    resolved settings and the run's shape."""
    world = trainer.dist.world
    settings = {
        "train": to_dict(cfg),
        "run": {
            "world_size": world,
            "global_batch_tokens": global_batch_tokens(cfg, world),
            "total_steps": trainer.total_steps,
        },
    }
    run = TrackerRun(Path(cfg.output), trainer.step, settings, resumed=cfg.resume)
    trackers = open_trackers(cfg.trackers(), run)
    return metrics_mod.RunSink(cfg.output, trainer.total_steps, start_step=trainer.step, trackers=trackers)


def _write_start_notes(cfg: TrainConfig, trainer: Trainer, dist: Dist, sink: metrics_mod.RunSink) -> None:
    """Tell the user, through the run's `sink` (rank 0), where the run starts: resume point, data split, draft
    vocabulary, mask token and compute dtype."""
    for line in _start_notes(cfg, trainer):
        sink.write(line)
    sink.write(describe_vocab_coverage(trainer.cache, trainer.vocab))
    if trainer.method.uses_mask_token:
        sink.write(describe_mask_token(trainer.cache, trainer.spec.mask_token_id))
    else:
        sink.write(f"method {cfg.method}: {cfg.depths} sequential steps per chain (training-time test)")
    why = describe_compute_dtype(cfg.precision, str(dist.device), trainer.precision)
    log.info("%s", why)
    sink.note(why)


def _check_extension(cfg: TrainConfig, trainer: Trainer) -> None:
    """A resume may change `steps`/`epochs` (the schedule is recomputed for the new total), never below the
    step the run has reached."""
    if trainer.total_steps < trainer.step:
        raise ResumeMismatch(
            f"cannot resume {cfg.output}: it is at step {trainer.step}, beyond the {trainer.total_steps} steps "
            "asked; give --steps of at least that"
        )


def _start_notes(cfg: TrainConfig, trainer: Trainer) -> list[str]:
    """Lines for the user at the start: resume point and schedule, what the data split left out."""
    split, held, world = trainer.split, trainer.eval_set, trainer.dist.world
    notes = [
        f"global batch: {global_batch_tokens(cfg, world)} tokens per optimizer step (tokens_per_step "
        f"{cfg.tokens_per_step} x {world} rank(s) x grad_accum {cfg.grad_accum})"
    ]
    if trainer.step:
        notes.append(f"resumed {cfg.output} at step {trainer.step} of {trainer.total_steps}")
    if trainer.step and trainer.saved_total not in (None, trainer.total_steps):
        lr_then = lr_at(trainer.step, cfg.lr, cfg.warmup, trainer.saved_total, cfg.schedule)
        lr_now = lr_at(trainer.step, cfg.lr, cfg.warmup, trainer.total_steps, cfg.schedule)
        notes.append(
            f"run length changed from {trainer.saved_total} to {trainer.total_steps} steps: the {cfg.schedule} "
            f"schedule is recomputed for {trainer.total_steps} steps from step {trainer.step} "
            f"(lr {lr_then:.3g} -> {lr_now:.3g}; warm-up is not repeated)"
        )
    warmup = effective_warmup(cfg.warmup, trainer.total_steps)
    if warmup != cfg.warmup:
        notes.append(
            f"warmup {cfg.warmup} is not below the run's {trainer.total_steps} steps (the lr would never reach "
            f"its peak): warming up over {warmup} step(s), a tenth of the run; pass --warmup to choose"
        )
    if cfg.extra_cache:
        starts = trainer.cache.starts  # a CacheUnion: the primary's ids come first
        extra = split.train_ids >= starts[1]
        notes.append(
            f"training on {int((~extra).sum())} samples of cache {cfg.cache} and {int(extra.sum())} of "
            f"{len(cfg.extra_cache)} extra cache(s) (held-out samples come from cache only)"
        )
    if split.shared_prompts:
        notes.append(
            f"left {split.shared_prompts} sample(s) out of training: their prompt is a held-out sample's prompt "
            "(so the held-out figures stay unseen)"
        )
    if split.skipped_unsupervised:
        notes.append(f"skipped {split.skipped_unsupervised} sample(s) without supervised tokens")
    cpus = usable_cpus()
    if cfg.num_workers > cpus:
        notes.append(
            f"num_workers {cfg.num_workers} is more than the {cpus} CPUs this process may use: the loader's "
            "workers and the step compete for them; set num_workers to at most that"
        )
    if len(held.eval_ids) < cfg.eval_samples:
        notes.append(
            f"eval_samples {cfg.eval_samples} capped at {len(held.eval_ids)}: at most half of the "
            f"{len(held.eval_ids) + len(held.train_ids) + held.shared_prompts} usable samples are held out"
        )
    return notes


def _finish(cfg: TrainConfig, final: dict[str, Any], sink: Any) -> None:
    """Plots, the export and the held-out summary at the end of a run (rank 0)."""
    with contextlib.suppress(BadInput):
        sink.add_plots(metrics_mod.plot(cfg.output))
    if cfg.export:
        sink.write(f"exported draft to {export_run(cfg.output, Path(cfg.output) / EXPORT_DIR, 'best')}")
    if final:
        acc, walk = final.get("acceptance"), final.get("acceptance_walk")
        walked = "" if walk is None else f" (vLLM's walk {walk:.3f})"
        sink.write(
            f"held-out: loss {final['loss']:.4f}, acceptance length "
            f"{'-' if acc is None else f'{acc:.3f}'}{walked}, agreement per depth "
            f"{[format_figure(a) for a in final['agreement']]}"
        )


def _forget_start(out: Path, lock: RankLock, created: bool, lock_created: bool) -> None:
    """A start that failed before training leaves nothing behind: the lock file and the folder, if it made them."""
    with contextlib.suppress(OSError):
        if lock_created:
            lock.path.unlink()
        if created:
            out.rmdir()  # only when empty: whatever else is there stays
