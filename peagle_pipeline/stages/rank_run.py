"""The run skeleton the target stages share (`generate` and `extract`: both run the target over this rank's rows).

A stage run goes: checks that need nothing written; the backend started for a new output only (so a failed start
leaves nothing stamped), then the output created or checked and this rank's writer opened (`open_beside`, which
closes a started backend when that fails); then this rank's rows (`RankRows`), each unit of work committed as it
is done with progress shown (`Progress`), and every way out handled once (`run_rank`): Ctrl-C or SIGTERM keeps what
is committed and says how much, a single rank with nothing usable is refused and a new output removed, the backend
is closed. What differs between the stages (what a unit is, how it is computed and committed) is the stage's
`RankWork`. Writes nothing itself.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, TypeVar

from peagle_pipeline.data.records import rank_rows
from peagle_pipeline.errors import BadInput
from peagle_pipeline.preemption import stop_error

__all__ = ["LINE_EVERY_S", "RankRows", "this_rank_rows", "Progress", "RankWork", "open_beside", "run_rank"]

LINE_EVERY_S = 10.0
"""Plain progress lines (no terminal): at most one per this many seconds."""

W = TypeVar("W")


class RankRows(NamedTuple):
    """This rank's rows of the data, in order, and how many there are (counted by a first pass that parses rows)."""

    total: int
    rows: Iterator[tuple[int, Any]]


def this_rank_rows(data: list[str], split: str | None, rank: int, world: int, limit: int | None) -> RankRows:
    """The rows rank `rank` of `world` works on: every world-th of the first `limit` rows (`data.records`)."""
    from peagle_pipeline.data.formats import iter_rows

    total = sum(1 for _ in rank_rows(iter_rows(data, split), rank, world, limit))
    return RankRows(total, rank_rows(iter_rows(data, split), rank, world, limit))


class Progress:
    """Progress over a rank's rows: a bar on a terminal; else (a pipe, SLURM, nohup) a plain line through `say`
    after a unit of work, at most one per LINE_EVERY_S and one at the end, with the rows done, the tokens/s and an
    ETA. TQDM_DISABLE=1 turns both off. Rows committed by an earlier run are `skip`ped: they count as done, not
    toward the rate or the ETA."""

    def __init__(
        self, total: int, desc: str, unit: tuple[str, str], say: Callable[[str], None] | None = None
    ) -> None:
        """`unit`: what a row is called on the bar and in the plain line, e.g. ("sample", "samples")."""
        from tqdm import tqdm

        self.total, self.desc, self.noun = total, desc, unit[1]
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.bar = tqdm(
            total=total, unit=unit[0], desc=desc, mininterval=1.0, dynamic_ncols=True, disable=None
        )
        self.plain = self.bar.disable and os.environ.get("TQDM_DISABLE", "").lower() in ("", "0", "false")
        self.done = self.skipped = self.tokens = 0
        self.idle_s = 0.0  # time of this run that computed no token (an engine's start): not in the rate
        self.start = self._last_line = time.perf_counter()

    def banner(self, line: str) -> None:
        """Write `line` once above the bar (with the bar only: a failing command prints one line on stderr)."""
        if line and not self.bar.disable:
            self.bar.write(line, file=sys.stderr)

    def skip(self, n: int) -> None:
        """`n` rows an earlier run committed."""
        self.skipped += n
        self.advance(n)

    def set_tokens(self, n: int, **postfix: Any) -> None:
        """`n` tokens computed this run so far: the rate shown beside the bar, with `postfix` (e.g. replies=12)."""
        self.tokens = n
        self.bar.set_postfix(**postfix, tok_s=f"{self.rate():.0f}", refresh=False)

    def advance(self, n: int, extra: str = "") -> None:
        """`n` more rows done this run; `extra` (e.g. "12 replies") goes into the plain line."""
        self.done += n
        self.bar.update(n)
        now = time.perf_counter()
        if self.plain and (now - self._last_line >= LINE_EVERY_S or self.done == self.total):
            self._last_line = now
            self.say(self.line(extra))

    def rate(self) -> float:
        """Tokens per second of this run so far (its idle time left out)."""
        return self.tokens / max(time.perf_counter() - self.start - self.idle_s, 1e-9)

    def line(self, extra: str = "") -> str:
        """ "store-0: 120/400 samples, 812 tokens/s, ETA 3m20s" (the ETA once this run has done a row)."""
        parts = [
            f"{self.done}/{self.total} {self.noun}",
            *([extra] if extra else []),
            f"{self.rate():.0f} tokens/s",
        ]
        fresh = self.done - self.skipped
        if 0 < fresh and self.done < self.total:
            busy = time.perf_counter() - self.start - self.idle_s
            parts.append(f"ETA {_duration(busy / fresh * (self.total - self.done))}")
        return f"{self.desc}: " + ", ".join(parts)

    def close(self) -> None:
        self.bar.close()


def _duration(seconds: float) -> str:
    """72 -> "1m12s", 4000 -> "1h06m"."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def open_beside(open_output: Callable[[], W], backend: Any) -> W:
    """`open_output()` (create or check the output, open this rank's writer); a started `backend` (or None) is
    closed if that fails, so no engine outlives a refused start."""
    try:
        return open_output()
    except BaseException:
        if backend is not None:
            backend.close()
        raise


class RankWork(Protocol):
    """What a target stage does for its rank inside `run_rank`."""

    def loop(self) -> None:
        """Compute and commit every unit of this rank's work not committed yet (starting the backend if needed)."""

    def committed(self) -> str:
        """What is committed so far, e.g. "12 samples of store-0"."""

    def nothing_usable(self) -> str | None:
        """After `loop`: the error when this rank kept nothing at all (None when it kept something)."""

    def finish(self) -> None:
        """Commit the end of the output (this rank's part of it is complete)."""

    def abort(self) -> None:
        """Drop what is not committed (the writer's open state); what is committed stays."""

    def remove_new(self) -> None:
        """Remove the output this call created (it holds nothing usable)."""

    def close_backend(self) -> None:
        """Close the backend if one was started."""


class _NothingUsable(Exception):
    """This (only) rank kept nothing: reported as BadInput once a new output is removed."""


def run_rank(
    work: RankWork, *, fresh: bool, world: int, unwritable: Callable[[OSError], None] | None = None
) -> None:
    """Run `work` and handle every way out: a single rank (`world` 1) that kept nothing raises BadInput, with the
    output removed when this call created it (`fresh`); Ctrl-C or SIGTERM raises Interrupted or Terminated saying
    how much is committed; an OSError goes to `unwritable` (which raises the error to report) when given; the
    backend is closed in every case.
    """
    try:
        work.loop()
        if world == 1 and (why := work.nothing_usable()) is not None:
            raise _NothingUsable(why)  # never committed: a re-run starts afresh
        work.finish()
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM (preemption): the committed work stays
        work.abort()
        raise stop_error(
            stop, f": {work.committed()} are committed; re-run the same command to resume"
        ) from None
    except _NothingUsable as err:
        work.abort()
        if fresh:  # nothing else is in it: leave the output as it was before this call
            work.remove_new()
        raise BadInput(str(err)) from None
    except OSError as err:
        work.abort()
        if unwritable is None:
            raise
        unwritable(err)
        raise
    except BaseException:
        work.abort()
        raise
    finally:
        work.close_backend()
