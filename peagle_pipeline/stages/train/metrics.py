"""Where training metrics go: metrics.jsonl, the experiment trackers, a tqdm bar; and PNG curves from metrics.jsonl.

A record is a flat dict: `step`, `kind` ("train" or "eval"), scalars (`loss`, `lr`, `tokens_per_s`, ...) and
per-depth lists (`agreement`: top-1 agreement at depth 0..K-1). Only rank 0 builds real sinks; other ranks get
`NullSink`. `StepWindow` sums the per-step statistics the trainer hands it into one record per log window;
nothing here touches models.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from peagle_pipeline.stages.run_layout import METRICS_FILE, PLOTS_DIR, TB_DIR
from peagle_pipeline.stages.run_records import read_metrics
from peagle_pipeline.stages.train.trackers import Tracker, scalars

__all__ = [
    "METRICS_FILE",
    "TB_DIR",
    "PLOTS_DIR",
    "StepStats",
    "StepWindow",
    "MetricSink",
    "NullSink",
    "RunSink",
    "read_metrics",
    "json_safe",
    "format_figure",
    "plot",
]

LINE_EVERY_S = 10.0  # plain progress lines (no terminal): at most one train line per this many seconds


@dataclass
class StepStats:
    """Global (all-rank) sums of one step."""

    loss_sum: float = 0.0
    count: int = 0
    correct: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)
    tokens: int = 0
    grad_norm: float = 0.0
    skipped: bool = False


class StepWindow:
    """Sums of the steps since the last log record, turned into one `train` record."""

    def __init__(self, depths: int) -> None:
        self.loss, self.count, self.tokens, self.steps, self.skipped = 0.0, 0, 0, 0, 0
        self.correct, self.total = [0] * depths, [0] * depths
        self.wait, self.elapsed, self.grad_norm = 0.0, 0.0, 0.0

    def to_state(self) -> dict[str, Any]:
        """The sums so far, for a checkpoint: a run stopped inside a log window resumes it (`from_state`), so the
        window's record is the one an uninterrupted run writes."""
        return dict(vars(self))

    @classmethod
    def from_state(cls, depths: int, state: dict[str, Any] | None) -> StepWindow:
        """A window holding the sums of `to_state` (an empty one for None: a checkpoint of an older version)."""
        window = cls(depths)
        if state is not None and len(state.get("correct", ())) == depths:
            for key in vars(window):
                setattr(window, key, state[key])
        return window

    def add(self, s: StepStats, wait: float, elapsed: float) -> None:
        """Count one step; a skipped step (no update) adds its time and tokens but no loss or agreement."""
        self.steps += 1
        self.skipped += int(s.skipped)
        if not s.skipped and math.isfinite(s.loss_sum):
            self.loss += s.loss_sum
            self.count += s.count
            self.correct = [
                a + b for a, b in zip(self.correct, s.correct or [0] * len(self.correct), strict=True)
            ]
            self.total = [a + b for a, b in zip(self.total, s.total or [0] * len(self.total), strict=True)]
        self.tokens += s.tokens
        self.wait += wait
        self.elapsed += elapsed
        self.grad_norm = s.grad_norm

    def record(self, step: int, lr: float, skipped_corrupt: int) -> dict[str, Any]:
        """The window as one `train` record; `loss` is None when every step of it was skipped."""
        return {
            "step": step,
            "kind": "train",
            "loss": self.loss / self.count if self.count else None,
            "lr": lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens / max(self.elapsed, 1e-9),
            "data_wait": self.wait / max(self.elapsed, 1e-9),
            "step_time": self.elapsed / max(self.steps, 1),
            "agreement": [c / t if t else None for c, t in zip(self.correct, self.total, strict=True)],
            "elements": self.count,
            "skipped_steps": self.skipped,
            "skipped_corrupt": skipped_corrupt,
        }


class MetricSink(Protocol):
    """Receives metric records; `progress` advances the bar by optimizer steps."""

    def log(self, record: dict[str, Any]) -> None: ...

    def progress(self, steps: int, postfix: dict[str, Any]) -> None: ...

    def write(self, line: str) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """The sink of non-zero ranks and of library use without output."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def progress(self, steps: int, postfix: dict[str, Any]) -> None:
        pass

    def write(self, line: str) -> None:
        pass

    def close(self) -> None:
        pass


def json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every non-finite float (also inside lists) as None and their keys listed under `nonfinite`,
    so metrics.jsonl stays strict JSON (`jq`, pandas) where json.dumps would write NaN or Infinity."""
    bad: list[str] = []

    def clean(key: str, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
            return None
        if isinstance(value, list):
            return [clean(key, v) for v in value]
        return value

    out = {k: clean(k, v) for k, v in record.items()}
    if bad:
        out["nonfinite"] = sorted(set(bad))
    return out


def format_figure(x: float | None, digits: int = 2) -> str:
    """`x` with `digits` decimals, or "-" for a figure not measured."""
    return "-" if x is None else f"{x:.{digits}f}"


class RunSink:
    """metrics.jsonl (append, line-buffered, fsync on close) + the run's trackers (stages/train/trackers.py:
    TensorBoard, W&B, MLflow) + progress: a tqdm bar on a terminal,
    else (SLURM, nohup, `| tee`) plain lines on stderr, one per eval and at most one per LINE_EVERY_S of training.

    On resume, records with step > `start_step` left by the killed run are dropped from metrics.jsonl first, so
    the file reads as one uninterrupted run.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        total_steps: int,
        start_step: int = 0,
        progress_bar: bool = True,
        trackers: Sequence[Tracker] = (),
    ) -> None:
        self.run_dir = Path(run_dir)
        path = self.run_dir / METRICS_FILE
        if path.exists():
            kept = [r for r in read_metrics(self.run_dir) if int(r.get("step", 0)) <= start_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (owned until close)
        self._trackers = list(trackers)
        self._bar = None
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                disable=None,
                mininterval=1.0,
            )
        self._lines = progress_bar and (self._bar is None or self._bar.disable)
        self._total, self._start_step = total_steps, start_step
        self._t0 = self._last_line = time.monotonic()
        self._printed = False

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        if self._lines:
            self._print_line(record)
        if self._trackers:
            values = scalars(record)
            for tracker in self._trackers:
                tracker.log(int(record["step"]), values)

    def _print_line(self, r: dict[str, Any]) -> None:
        """One plain progress line for a record (no terminal: the bar is off)."""
        step, now = int(r["step"]), time.monotonic()

        def num(x: Any, spec: str) -> str:
            return "-" if x is None or not math.isfinite(x) else format(x, spec)

        if r.get("kind") == "eval":
            agree = " ".join(num(a, ".2f") for a in r.get("agreement", []))
            copies = ""
            walk = (
                ""
                if r.get("acceptance_walk") is None
                else f" (vLLM's walk {num(r['acceptance_walk'], '.3f')})"
            )
            if r.get("copy_share") is not None:
                copies = (
                    f"; {100 * r['copy_share']:.0f} % of positions copy the context, depth-0 agreement there "
                    f"{num(r.get('copy_agreement'), '.2f')}"
                )
            line = (
                f"eval at step {step}: loss {num(r.get('loss'), '.4f')}, acceptance length "
                f"{num(r.get('acceptance'), '.3f')}{walk}, agreement per depth [{agree}]{copies}"
            )
        elif self._printed and step < self._total and now - self._last_line < LINE_EVERY_S:
            return
        else:
            done = step - self._start_step
            elapsed = now - self._t0
            eta = elapsed / done * (self._total - step) if done > 0 else 0.0
            skipped = f", {r['skipped_steps']} step(s) skipped" if r.get("skipped_steps") else ""
            line = (
                f"step {step}/{self._total} ({100 * step / max(self._total, 1):.0f}%): loss "
                f"{num(r.get('loss'), '.4f')}, lr {num(r.get('lr'), '.3g')}, "
                f"{num(r.get('tokens_per_s'), '.0f')} tok/s, elapsed {_hms(elapsed)}, eta {_hms(eta)}{skipped}"
            )
            self._last_line, self._printed = now, True
        self.write(line)

    def progress(self, steps: int, postfix: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(steps)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def write(self, line: str) -> None:
        """A message for the user (stderr) that does not break the progress bar."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    def add_plots(self, paths: Sequence[Path]) -> None:
        """The run's PNG plots, at its end, to each tracker."""
        for tracker in self._trackers:
            tracker.add_plots(paths)

    def note(self, line: str) -> None:
        """A start-of-run note shown above the progress bar only while the bar is shown (a terminal, no
        TQDM_DISABLE), so that a failing command still prints one line on stderr."""
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def plot(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Write loss.png, agreement.png and acceptance.png under RUN/plots from metrics.jsonl; returns their paths.

    Raises:
        BadInput: the run has no metrics.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from peagle_pipeline.errors import BadInput

    records = read_metrics(run_dir)
    if not records:
        raise BadInput(f"no {METRICS_FILE} records in {run_dir}: train first")
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    out_dir = Path(run_dir) / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = (
        ("loss.png", _plot_loss, (train, evals)),
        ("agreement.png", _plot_agreement, (train, evals)),
        ("acceptance.png", _plot_acceptance, (evals,)),
    )
    written = []
    for name, draw, args in figures:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        draw(ax, *args)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out_dir / name))
    return written


def _plot_loss(ax: Any, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
    """Train loss per logged window (red lines: windows with skipped steps) and held-out loss."""
    trained = [r for r in train if r.get("loss") is not None]  # None: every step of the window was skipped
    ax.plot([r["step"] for r in trained], [r["loss"] for r in trained], label="train")
    for i, step in enumerate(
        r["step"] for r in train if r.get("skipped_steps")
    ):  # no update: not a loss of 0
        ax.axvline(step, color="tab:red", alpha=0.3, lw=0.8, label=None if i else "window with skipped steps")
    scored = [r for r in evals if r.get("loss") is not None]
    if scored:
        ax.plot([r["step"] for r in scored], [r["loss"] for r in scored], "o-", label="held-out")
    ax.set(xlabel="optimizer step", ylabel="KL(target || draft) per element", title="Loss")
    ax.legend()


def _plot_agreement(ax: Any, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
    """Per-depth top-1 agreement, held-out when evaluated, else train."""
    source = evals or train
    depths = max((len(r.get("agreement", [])) for r in source), default=0)
    for d in range(depths):
        pts = [
            (r["step"], r["agreement"][d])
            for r in source
            if len(r.get("agreement", [])) > d and r["agreement"][d] is not None
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-" if evals else "-", label=f"depth {d}")
    ax.set(
        xlabel="optimizer step",
        ylabel="top-1 agreement",
        ylim=(0, 1),
        title=f"Per-depth top-1 agreement ({'held-out' if evals else 'train'})",
    )
    if depths:
        ax.legend(ncol=2, fontsize="small")


def _plot_acceptance(ax: Any, evals: list[dict[str, Any]]) -> None:
    """The estimated acceptance lengths of every evaluation (mean over anchors; vLLM's walk where recorded)."""
    for key, label, color in (
        ("acceptance", "mean over anchors", "tab:green"),
        ("acceptance_walk", "vLLM's walk", "tab:purple"),
    ):
        pts = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", color=color, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    if any(r.get("acceptance_walk") is not None for r in evals):
        ax.legend(fontsize="small")
    ax.set(
        xlabel="optimizer step",
        ylabel="tokens per verification (est.)",
        title="Estimated acceptance length (held-out, full-depth chains)",
    )


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
