"""The trainer of one run: draft, optimizer, data stream, steps, held-out figures and checkpoints.

One optimizer step, composed (each arrow a tested pure call):
packed row -> `core.cod.build_layout` (generator seeded by (seed, epoch, row); every chain to full depth for
EAGLE-3) -> `core.partition.plan_segments` -> mask (`core.mask.dense_mask` on CPU, `build_block_mask` on CUDA) ->
the method's forward (`stages.train.methods`: `PEagleDraft` in one pass, or `Eagle3Draft`'s K steps) through the
DDP-wrapped (or FSDP-sharded, `--fsdp`: `stages.train.fsdp`) draft -> chunked KL `(loss_sum, count)` -> scale by
world / GLOBAL count (counted before any backward) -> backward per segment (gradients reduced on the last only) ->
clip -> AdamW at `lr_at(step)`.
Under FSDP every forward and backward is a collective, so all ranks run as many passes as the busiest one (the
others add passes whose loss counts zero) and all ranks evaluate.

Randomness: COD draws use a fresh generator per packed row seeded by (seed, epoch, row index), so resuming and
changing how rows are spread over ranks/micro-steps give bit-identical layouts; the shuffle is seeded by
(seed, epoch), the held-out split and the init by seed. The checkpoint keeps the data cursor and step (all a
resume needs) plus torch's global RNG state as a guard. Process groups, logging sinks and seeding happen in
`stages.train.stage.run()` only. Outputs (checkpoints, metrics, export) are written by rank 0 only.

Test hook: PEAGLE_TEST_STEP_SLEEP=<seconds> sleeps after every step, so a signal test can land a stop inside a log
window rather than on its boundary. Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from peagle_pipeline.config import TrainConfig
from peagle_pipeline.core import cod, loss, mask, partition
from peagle_pipeline.errors import CorruptCache, NumericalFault, OutOfSpace, StoreUnreachable
from peagle_pipeline.hardware import resolve_compute_dtype
from peagle_pipeline.model_dir import text_config
from peagle_pipeline.preemption import stop_error
from peagle_pipeline.runtime import pause_for_crash_test
from peagle_pipeline.stages.checkpoint import CheckpointManager
from peagle_pipeline.stages.train import fsdp
from peagle_pipeline.stages.train import metrics as metrics_mod
from peagle_pipeline.stages.train.distributed import Dist
from peagle_pipeline.stages.train.draft import build_draft
from peagle_pipeline.stages.train.held_out_eval import evaluate_held_out
from peagle_pipeline.stages.train.loader import Cursor, TrainLoader, ahead_to_device
from peagle_pipeline.stages.train.methods import method_for
from peagle_pipeline.stages.train.metrics import StepStats, StepWindow, format_figure
from peagle_pipeline.stages.train.optim import build_optimizer, clip_grad_norm, lr_at
from peagle_pipeline.stages.train.packed_batch import PackedBatch
from peagle_pipeline.stages.train.prepared_row import Prepared, lay_out_row
from peagle_pipeline.stages.train.train_data import check_truncation, hold_out, loader_settings, training_data

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

STEP_SLEEP_ENV = "PEAGLE_TEST_STEP_SLEEP"  # the test hook of the module docstring


class Trainer:
    """Owns the model, optimizer, data stream and checkpoints of one run (one per process)."""

    def __init__(self, cfg: TrainConfig, dist: Dist, sink: Any = None) -> None:
        self.cfg, self.dist, self.micro_steps = cfg, dist, cfg.grad_accum
        self.cache, self.split = training_data(cfg)  # with extra_cache: a CacheUnion
        self.method = method_for(cfg.method)
        self.model, self.spec, self.vocab = build_draft(self.cache, cfg)
        self.model.to(dist.device)
        if dist.world == 1 and dist.device.type == "cpu":
            # The embedding table's gradient as the rows a step touched: a dense [V, H] gradient is allocated and
            # zero-filled every step, about a sixth of a CPU step for SmolLM2 (RowSparseAdamW takes either).
            # DDP all-reduces dense gradients, so several ranks keep them.
            self.model.embed_tokens.sparse = True
        self.ddp: torch.nn.Module = self.model
        self.sharded = cfg.fsdp and dist.world > 1  # one process: nothing to shard
        if self.sharded:
            fsdp.shard(
                self.model, dist.device, dist.world
            )  # in place: self.model is the sharded module (dense embedding gradient)
        elif dist.world > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None
            )
        self.optimizer = build_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.cod = cfg.cod()
        self.split, self.eval_cache, self.eval_set = hold_out(self.cache, self.split, cfg)
        check_truncation(self.split, cfg.tokens_per_step)
        settings = dataclasses.replace(loader_settings(cfg), pin_memory=dist.device.type == "cuda")
        self.loader = TrainLoader(self.cache, self.split, settings, dist.rank, dist.world, self.micro_steps)
        self.total_steps = cfg.steps or sum(self.loader.steps_in_epoch(e) for e in range(cfg.epochs))
        self.ckpt = CheckpointManager(cfg.output, cfg.keep_checkpoints)
        self.sink = sink or metrics_mod.NullSink()
        self.step, self.cursor, self.bad_steps = 0, Cursor(), 0
        self.best: float | None = None
        self.skipped_corrupt = 0
        self.window = StepWindow(
            cfg.depths
        )  # the log window in progress (checkpointed: a resume continues it)
        self.saved_total: int | None = (
            None  # total_steps of the checkpoint restored (None: fresh or older run)
        )
        self.precision = resolve_compute_dtype(cfg.precision, str(dist.device))  # auto -> from the hardware
        self.autocast: dict[str, Any] = dict(
            device_type=dist.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"
        )
        if cfg.target == "exact":
            self.target_norm = self.cache.target_pieces()["norm.weight"].to(dist.device)
            self.target_eps = float(text_config(self.cache.target_config()).get("rms_norm_eps", 1e-6))

    # ---- state ---------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.cursor.epoch,
            "epoch_step": self.cursor.step,
            "bad_steps": self.bad_steps,
            "best": self.best,
            "skipped_corrupt": self.skipped_corrupt,
            "torch_rng": torch.get_rng_state(),
            "seed": self.cfg.seed,
            "total_steps": self.total_steps,
            "log_window": self.window.to_state(),
        }

    def restore(self) -> bool:
        """Load the highest complete checkpoint, if any; True when one was loaded."""
        ckpt = self.ckpt.load_latest()
        if ckpt is None:
            return False
        if self.sharded:
            fsdp.load_state(self.model, self.optimizer, ckpt.model, ckpt.optimizer)  # type: ignore[arg-type]
        else:
            self.model.load_state_dict(
                {k: v.to(self.dist.device) for k, v in ckpt.model.items()}, strict=True
            )
            self.optimizer.load_state_dict(ckpt.optimizer)  # type: ignore[arg-type]  # loaded with_optimizer
        s = ckpt.state
        self.step, self.cursor = int(s["step"]), Cursor(int(s["epoch"]), int(s["epoch_step"]))
        self.bad_steps, self.best, self.skipped_corrupt = (
            int(s["bad_steps"]),
            s["best"],
            int(s["skipped_corrupt"]),
        )
        torch.set_rng_state(s["torch_rng"])
        self.saved_total = int(s["total_steps"]) if "total_steps" in s else None
        self.window = StepWindow.from_state(self.cfg.depths, s.get("log_window"))
        return True

    def save(self, best: bool = False, metrics: dict[str, Any] | None = None) -> None:
        """Checkpoint the current step (rank 0 writes).

        Raises:
            NumericalFault: the weights are no longer finite (such a checkpoint would only poison a resume).
        """
        model = fsdp.gather_model_state(self.model) if self.sharded else self.model.state_dict()
        bad = [k for k, v in model.items() if v.is_floating_point() and not v.isfinite().all()]
        if self.sharded and self.dist.all_sum(torch.tensor([float(len(bad))]))[0] > 0:
            bad = bad or ["(on rank 0)"]  # only rank 0 holds the gathered weights: every rank stops
        if bad:
            raise NumericalFault(
                f"weights became non-finite by step {self.step} ({', '.join(bad[:3])}): not saved; the learning "
                "rate is likely too high (resume from the last checkpoint with a lower one in a new run)"
            )
        optim = fsdp.gather_optimizer_state(self.model, self.optimizer) if self.sharded else None
        if self.dist.main:
            self.ckpt.save(
                self.step,
                model,
                optim or self.optimizer.state_dict(),
                self.state(),
                {"metrics": metrics or {}},
                best=best,
            )
        self.dist.barrier()

    # ---- one step ------------------------------------------------------------------------------------------
    def prepare(self, batch: PackedBatch, full: bool = False) -> Prepared:
        """Raise what emptied the row (an unanswered read, no shared memory, a corrupt sample unless skip_corrupt:
        those are counted), then sample its COD layout and plan its segments (`prepared_row.lay_out_row`)."""
        if batch.unreachable:
            raise StoreUnreachable(batch.unreachable)
        if batch.no_shared_memory:
            raise OutOfSpace(batch.no_shared_memory)
        if batch.corrupt:
            sid, msg = batch.corrupt[0]
            if not self.cfg.skip_corrupt:
                raise CorruptCache(
                    f"{msg} (sample {sid}); re-extract, or re-run the same command with --resume --skip-corrupt "
                    "to skip such samples"
                )
            self.skipped_corrupt += len(batch.corrupt)
            log.warning("skipped %d corrupt sample(s) in row %d: %s", len(batch.corrupt), batch.row, msg)
        full = full or self.method.full_chains
        return lay_out_row(batch, self.cfg, self.cod, self.vocab, self.dist.device, full)

    def _mask(self, lay: cod.CODLayout, query: torch.Tensor | None = None) -> Any:
        if self.dist.device.type == "cuda":
            return mask.build_block_mask(lay, self.dist.device, query)
        return mask.dense_mask(lay, query)

    def forward_segment(
        self, p: Prepared, seg: partition.Segment, module: torch.nn.Module
    ) -> loss.LossOutput:
        """Forward one segment through `module` (DDP-wrapped in training) by the run's method and return its loss
        sums."""
        with torch.autocast(**self.autocast):
            hidden = self.method.hidden(module, p, seg, self._mask, self.model.cfg.num_layers)
            owned = seg.owned_elements
            rows, depth = p.layout.target[owned], p.layout.depth[owned]
            w = self.method.loss_weight(self.cfg, depth, p.valid[owned])
            head = self.model.lm_head.weight
            counted = loss.Counted(w, depth, self.cfg.depths)
            if self.cfg.target == "exact":
                last = p.batch.last_hidden[rows]  # type: ignore[index]  # read when target is exact
                return loss.kl_exact(
                    hidden, head, last, (self.target_norm, self.target_eps), counted, self.cfg.loss_chunk
                )
            ids, lp = p.batch.topk_ids[rows], p.batch.topk_logprobs[rows]
            return loss.kl_topk(hidden, head, ids, lp, counted, self.vocab, self.cfg.loss_chunk)

    def train_step(self, micro: list[PackedBatch]) -> StepStats:
        """Forward/backward every micro-batch and segment, then one guarded optimizer update."""
        self.ddp.train()
        prepared = [self.prepare(b) for b in micro]
        K = self.cfg.depths
        local_count = sum(int(p.valid.sum()) for p in prepared)
        count = int(self.dist.all_sum(torch.tensor([local_count], dtype=torch.float64))[0])
        # loss_sum, tokens, correct[K], total[K], summed on the device: one copy to the host per step, not three
        # per segment (float64 throughout, so the sums are those of the host-side float() additions)
        acc = torch.zeros(2 + 2 * K, dtype=torch.float64, device=self.dist.device)
        acc[1] = sum(p.batch.num_tokens for p in prepared)
        if count > 0:
            self._backward_all([(p, s) for p in prepared for s in p.segments], count, acc)
        acc = self.dist.all_sum(acc.cpu())
        stats = StepStats(
            loss_sum=float(acc[0]),
            count=count,
            correct=acc[2 : 2 + K].long().tolist(),
            total=acc[2 + K :].long().tolist(),
            tokens=int(acc[1]),
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        if count == 0:
            self.optimizer.zero_grad(set_to_none=True)
            stats.skipped = True
            return stats
        norm = clip_grad_norm(
            params,
            self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf,
            self.dist.all_sum if self.sharded else None,
        )
        stats.grad_norm = float(norm)
        if not (math.isfinite(stats.loss_sum) and math.isfinite(stats.grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            stats.skipped = True
            msg = (
                f"step {self.step + 1}: non-finite loss or gradient (loss sum {stats.loss_sum}, grad norm "
                f"{stats.grad_norm}); update skipped ({self.bad_steps}/{self.cfg.max_bad_steps} in a row)"
            )
            log.warning(msg)
            if self.bad_steps >= self.cfg.max_bad_steps:
                raise NumericalFault(
                    f"{self.bad_steps} consecutive steps with non-finite loss or gradients; "
                    "lower lr, use precision=fp32, or check the cache with `verify`"
                )
            return stats
        self.bad_steps = 0
        lr = lr_at(self.step, self.cfg.lr, self.cfg.warmup, self.total_steps, self.cfg.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def _backward_all(
        self, work: list[tuple[Prepared, partition.Segment]], count: int, acc: torch.Tensor
    ) -> None:
        """Forward/backward every (row, segment) of this rank with loss scale world / `count` (the global count:
        DDP and FSDP average over ranks); sums loss, correct and total into `acc` [2 + 2K]."""
        K, scale = self.cfg.depths, self.dist.world / count
        passes = self._most_over_ranks(len(work)) if self.sharded else len(work)
        for i in range(passes):
            sync = i == passes - 1
            if self.sharded:
                self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]  # an FSDPModule
                ctx: Any = contextlib.nullcontext()
            else:
                ctx = self.ddp.no_sync() if (self.dist.world > 1 and not sync) else contextlib.nullcontext()  # type: ignore[operator]
            with ctx:
                if i >= len(work):  # FSDP: match the busiest rank's collectives with a pass that counts zero
                    self._idle_pass(work[-1] if work else None)
                    continue
                out = self.forward_segment(*work[i], self.ddp)
                (out.loss_sum * scale).backward()
            acc[0] += out.loss_sum.detach().double()
            acc[2 : 2 + K] += out.correct.double()
            acc[2 + K :] += out.total.double()
        if not passes and self.dist.world > 1:  # keep DDP's collective pattern: a zero-loss backward
            self._zero_backward()

    def _most_over_ranks(self, n: int) -> int:
        """The largest `n` of all ranks."""
        each = torch.zeros(self.dist.world, dtype=torch.float64)
        each[self.dist.rank] = n
        return int(self.dist.all_sum(each).max())

    def _idle_pass(self, item: tuple[Prepared, partition.Segment] | None) -> None:
        """A forward/backward whose gradient is zero: `item` again, or one depth-0 element when this rank has none
        (every parameter takes part either way, so the FSDP collectives match)."""
        if item is not None:
            (self.forward_segment(*item, self.ddp).loss_sum * 0.0).backward()
            return
        with torch.autocast(**self.autocast):
            hidden = self.method.idle_hidden(self.ddp, self.model.cfg.aux_size, self.dist.device, self._mask)
        (hidden.float().sum() * 0.0).backward()

    def _zero_backward(self) -> None:
        out = sum(p.sum() * 0.0 for p in self.ddp.parameters() if p.requires_grad)
        out.backward()  # type: ignore[union-attr]

    # ---- evaluation ----------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any] | None:
        """Held-out loss, per-depth top-1 agreement and estimated acceptance length (`held_out_eval`)."""
        return evaluate_held_out(self)

    # ---- the loop ------------------------------------------------------------------------------------------
    def fit(self, should_stop: Any = None) -> dict[str, Any]:
        """Run steps until `total_steps`; eval, save and log on their cadences. Returns the final eval record.

        `should_stop()` is asked before every step and returns the stop signal received (0 = none): when any
        rank got one, the current step is saved and `Interrupted` (SIGINT) or `Terminated` (SIGTERM) is raised.

        Raises:
            Interrupted: a stop was requested (after the checkpoint is written).
        """
        cfg = self.cfg
        last_eval: dict[str, Any] | None = None
        saved_at = self.step
        # `closing` ends the loader's worker on every way out. Left to the interpreter's exit, the worker would be
        # sent a SIGTERM that it ignores (`preemption.ignore_in_worker`), and the exit would wait on it forever.
        with contextlib.closing(
            ahead_to_device(self.loader.iterate(self.cursor), self.dist.device)
        ) as stream:
            while self.step < self.total_steps:
                signum = self._stop_signal(should_stop()) if should_stop is not None else 0
                if signum:
                    self._stop(signum, saved_at)
                self._run_step(stream)
                done = self.step == self.total_steps
                if self.step % cfg.log_every == 0 or done:
                    self._log_window()
                self.sink.progress(1, {})
                if (self.step % cfg.eval_every == 0 or done) and self.eval_set.eval_ids.size:
                    last_eval, saved_best = self._evaluate_and_keep_best()
                    if saved_best:
                        saved_at = self.step
                if (self.step % cfg.save_every == 0 or done) and saved_at != self.step:
                    self.save()
                    saved_at = self.step
        if self.sharded:
            self._log_shards()
        return last_eval or {}

    def _stop(self, signum: int, saved_at: int) -> None:
        """Save the current step (unless step `saved_at` is it) and raise the stop `signum` asked for."""
        if saved_at != self.step:
            self.save()
        raise stop_error(
            signum,
            f" at step {self.step} of {self.total_steps}: "
            + (f"checkpoint step-{self.step} saved" if self.step else "nothing trained yet")
            + "; re-run with --resume to continue",
        )

    def _run_step(self, stream: Iterator[tuple[Cursor, list[PackedBatch]]]) -> None:
        """Take the next step's rows from `stream`, train on them and add the step to the log window."""
        t0 = time.perf_counter()
        cursor, micro = next(stream)
        t_data = time.perf_counter() - t0
        stats = self.train_step(micro)
        self.cursor, self.step = cursor, self.step + 1
        self.window.add(stats, t_data, time.perf_counter() - t0)
        pause_for_crash_test(STEP_SLEEP_ENV)

    def _log_window(self) -> None:
        """Log the window of steps since the last log line (metrics and progress bar) and start a new one."""
        cfg = self.cfg
        record = self.window.record(
            self.step,
            lr_at(self.step - 1, cfg.lr, cfg.warmup, self.total_steps, cfg.schedule),
            self.skipped_corrupt,
        )
        self.sink.log(record)
        self.window = StepWindow(cfg.depths)
        self.sink.progress(
            0,
            {
                "loss": format_figure(record["loss"], 3),
                "agree0": format_figure(record["agreement"][0]),
                "tok/s": f"{record['tokens_per_s']:.0f}",
            },
        )

    def _evaluate_and_keep_best(self) -> tuple[dict[str, Any] | None, bool]:
        """Evaluate, log the record and checkpoint a new best acceptance (`best`): (the record on rank 0, else
        None; whether the step was saved)."""
        # FSDP: the forward is a collective, every rank evaluates (rank 0 reports)
        last_eval = self.evaluate() if self.dist.main or self.sharded else None
        last_eval = last_eval if self.dist.main else None
        is_best = False
        if last_eval is not None:
            self.sink.log(last_eval)
            acc = last_eval["acceptance"]
            is_best = acc is not None and (self.best is None or acc > self.best)
            if is_best:
                self.best = acc
        flag = self.dist.all_sum(torch.tensor([1.0 if is_best else 0.0]))
        if float(flag[0]) > 0:
            self.save(best=True, metrics=last_eval)
            return last_eval, True
        return last_eval, False

    def _log_shards(self) -> None:
        """Tell the optimizer state each rank holds (FSDP): one line on rank 0."""
        each = torch.zeros(self.dist.world, dtype=torch.float64)
        each[self.dist.rank] = fsdp.optimizer_bytes(self.optimizer)
        held = ", ".join(f"{b / 2**20:.3f}" for b in self.dist.all_sum(each).tolist())
        self.sink.write(f"fsdp: optimizer state per rank {held} MiB")

    def _stop_signal(self, local: int) -> int:
        """The stop signal any rank received, 0 for none (one tiny all-reduce per step under DDP; SIGTERM wins
        over SIGINT when ranks got different ones)."""
        if self.dist.world == 1:
            return local
        got = self.dist.all_sum(torch.tensor([float(local == 15), float(local == 2)]))
        return 15 if float(got[0]) > 0 else (2 if float(got[1]) > 0 else 0)
