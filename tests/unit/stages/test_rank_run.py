"""The run skeleton of the target stages (stages/rank_run.py): every way out of a rank's run, and its progress."""

from __future__ import annotations

import pytest

from peagle_pipeline.errors import BadInput, Interrupted
from peagle_pipeline.stages.rank_run import Progress, open_beside, run_rank


class Backend:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class Work:
    """A rank's work whose loop does `action` and keeps `kept` units; it records the calls run_rank makes."""

    def __init__(self, action=None, kept: int = 1) -> None:
        self.action, self.kept, self.calls = action, kept, []
        self.backend = Backend()

    def loop(self) -> None:
        self.calls.append("loop")
        if self.action is not None:
            raise self.action

    def committed(self) -> str:
        return f"{self.kept} units of part-0"

    def nothing_usable(self) -> str | None:
        return None if self.kept else "no usable units in data.jsonl"

    def finish(self) -> None:
        self.calls.append("finish")

    def abort(self) -> None:
        self.calls.append("abort")

    def remove_new(self) -> None:
        self.calls.append("remove")

    def close_backend(self) -> None:
        self.backend.close()


def test_a_finished_loop_is_committed_and_the_backend_closed():
    work = Work()
    run_rank(work, fresh=True, world=1)
    assert work.calls == ["loop", "finish"] and work.backend.closed == 1


@pytest.mark.parametrize(("fresh", "removed"), [(True, True), (False, False)])
def test_a_single_rank_that_kept_nothing_is_refused_and_only_a_new_output_removed(fresh, removed):
    work = Work(kept=0)
    with pytest.raises(BadInput, match="no usable units in data.jsonl"):
        run_rank(work, fresh=fresh, world=1)
    assert ("remove" in work.calls) is removed and "finish" not in work.calls and work.backend.closed == 1


def test_one_of_several_ranks_may_keep_nothing():
    work = Work(kept=0)
    run_rank(work, fresh=True, world=2)
    assert work.calls == ["loop", "finish"]


def test_ctrl_c_keeps_the_committed_work_and_says_how_much():
    work = Work(action=KeyboardInterrupt(), kept=7)
    with pytest.raises(
        Interrupted, match="7 units of part-0 are committed; re-run the same command to resume"
    ):
        run_rank(work, fresh=False, world=1)
    assert work.calls == ["loop", "abort"] and work.backend.closed == 1


def test_an_os_error_goes_to_unwritable_after_the_abort():
    seen = []

    def unwritable(err: OSError) -> None:
        seen.append(err.errno)
        raise BadInput("cannot write")

    work = Work(action=PermissionError(13, "denied"))
    with pytest.raises(BadInput, match="cannot write"):
        run_rank(work, fresh=True, world=1, unwritable=unwritable)
    assert seen == [13] and work.calls == ["loop", "abort"] and work.backend.closed == 1


def test_any_other_error_aborts_and_passes_through():
    work = Work(action=RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        run_rank(work, fresh=True, world=1)
    assert work.calls == ["loop", "abort"] and work.backend.closed == 1


def test_open_beside_closes_a_started_backend_when_the_output_cannot_be_opened():
    backend = Backend()

    def refuse() -> None:
        raise BadInput("not a cache")

    with pytest.raises(BadInput):
        open_beside(refuse, backend)
    assert backend.closed == 1
    assert open_beside(lambda: "writer", backend) == "writer" and backend.closed == 1
    assert open_beside(lambda: "writer", None) == "writer"


def test_plain_progress_lines_say_rows_tokens_per_second_and_eta(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    lines: list[str] = []
    p = Progress(10, "store-0", ("sample", "samples"), lines.append)  # stderr is no terminal under pytest
    assert p.plain
    p.skip(4)  # committed by an earlier run: done, not in the rate or the ETA
    p.start -= 12.0  # twelve seconds of this run so far, and no line yet
    p._last_line -= 12.0
    p.tokens = 1200
    p.advance(3)
    p.advance(3)
    p.close()
    assert (
        len(lines) == 2
    )  # the first after a row of this run (more than LINE_EVERY_S since the start), the end
    assert lines[0].startswith("store-0: 7/10 samples, ") and "tokens/s, ETA " in lines[0]
    eta = lines[0].rsplit("ETA ", 1)[1]
    assert eta in ("12s", "13s")  # 12 s for 3 rows, 3 rows left
    assert lines[1].startswith("store-0: 10/10 samples, ") and "ETA" not in lines[1]
    assert 90 < float(lines[1].split(", ")[1].split()[0]) <= 100  # 1200 tokens in about 12 s


def test_progress_is_silent_with_tqdm_disable(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    lines: list[str] = []
    p = Progress(2, "rows-0", ("conv", "conversations"), lines.append)
    p.advance(2, "3 replies")
    p.close()
    assert lines == []
