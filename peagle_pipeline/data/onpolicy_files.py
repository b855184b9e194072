"""The on-policy data format: the output directory of `generate` (docs/guides/generate.md), written by the `generate` stage
and read back as a dataset by `formats.py`. It holds generate.json, and per rank a rows file, a rejects file and
a state file that is the only truth about what is committed.

A chunk commits in three steps: its rows and rejects are appended to their JSONL files and fsynced, then the
state file (committed counts and byte lengths) is replaced atomically. Bytes past the recorded lengths are left
by a killed run and are truncated when the rank is opened again, so a resume rewrites them identically; a reader
reads only the committed bytes of finished ranks (`committed_rows_files`). Never generates anything;
`stages/generate/stage.py` decides what goes in.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from peagle_pipeline.core.settings import setting_differences
from peagle_pipeline.errors import BadInput, IncompatibleCache, ResumeMismatch
from peagle_pipeline.runtime import (
    RankLock,
    atomic_write_json,
    claim_output_dir,
    create_exclusive,
    fsync_dir,
    pause_for_crash_test,
    raise_if_no_space,
)

__all__ = [
    "FORMAT",
    "META_FILE",
    "WRITER_LOCK_PREFIX",
    "SLEEP_ENV",
    "rows_file",
    "rejects_file",
    "state_file",
    "encode_line",
    "prepare_output",
    "recorded_template_time",
    "recorded_target",
    "remove_new_output",
    "ChunkOutput",
    "OnPolicyWriter",
    "committed_rows_files",
]

FORMAT = "peagle-onpolicy/1"
META_FILE = "generate.json"  # marks a directory written by `peagle-pipeline generate`
WRITER_LOCK_PREFIX = ".peagle-lock-"  # the lock file of a rank's writer (holds a process id, not data)
SLEEP_ENV = "PEAGLE_TEST_GENERATE_SLEEP"
"""Test hook: seconds to sleep between a chunk's appended rows and its state update (widens the crash window)."""


def _rank_tag(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}"


def rows_file(rank: int, world_size: int) -> str:
    return f"rows-{_rank_tag(rank, world_size)}.jsonl"


def rejects_file(rank: int, world_size: int) -> str:
    return f"rejects-{_rank_tag(rank, world_size)}.jsonl"


def state_file(rank: int, world_size: int) -> str:
    return f"state-{_rank_tag(rank, world_size)}.json"


def encode_line(obj: dict[str, Any]) -> bytes:
    """One JSONL line: compact, UTF-8 (not ASCII-escaped), deterministic key order as given."""
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def prepare_output(root: Path, meta: dict[str, Any]) -> Path:
    """Create or check the output directory: generate.json is written once (exclusive create) and compared after
    (all but its `info` part: paths and versions may change between runs).

    Raises:
        OutputExists: the directory holds something that is not a generate output.
        IncompatibleCache: generate.json is damaged or of another format.
        ResumeMismatch: the output was started with other settings (the message names them).
    """
    claim_output_dir(root, META_FILE, "a generate output")
    meta_path = root / META_FILE
    create_exclusive(meta_path, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    try:
        found = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise IncompatibleCache(f"{meta_path} is damaged; use a new output directory") from None
    if found.get("format") != meta["format"]:
        raise IncompatibleCache(
            f"{root} holds generate output of format {found.get('format')!r}; this version writes "
            f"{meta['format']!r}: use a new output directory"
        )
    diffs = _differences(
        {k: v for k, v in found.items() if k != "info"}, {k: v for k, v in meta.items() if k != "info"}
    )
    if diffs:
        raise ResumeMismatch(
            f"{root} was generated with other settings ({'; '.join(diffs)}); "
            "use the original settings to resume, or a new output directory"
        )
    return root


def recorded_template_time(root: Path) -> datetime | None:
    """The time the chat template was given as "now" when the output was started (generate.json's
    `info.template_time`), so that a resumed run's prompts carry the same date; None for outputs without it."""
    try:
        stamp = json.loads((root / META_FILE).read_text(encoding="utf-8"))["info"]["template_time"]
        return datetime.fromisoformat(stamp)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recorded_target(root: Path) -> dict[str, str]:
    """The target a generate output was made with (generate.json's `target`: the sha256 of its config.json,
    tokenizer files and chat template); {} for an output without a readable record."""
    try:
        target = json.loads((root / META_FILE).read_text(encoding="utf-8")).get("target")
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in target.items() if isinstance(v, str)} if isinstance(target, dict) else {}


def remove_new_output(root: Path, rank: int, world_size: int, existed: bool) -> None:
    """Remove what a first run of this rank created in `root` (nothing else was in it), and `root` if it is new."""
    for name in (
        META_FILE,
        rows_file(rank, world_size),
        rejects_file(rank, world_size),
        state_file(rank, world_size),
    ):
        (root / name).unlink(missing_ok=True)
    (root / f"{WRITER_LOCK_PREFIX}{_rank_tag(rank, world_size)}").unlink(missing_ok=True)
    if not existed:
        with contextlib.suppress(OSError):
            root.rmdir()


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    found = setting_differences(old, new, ordered=True, nested=True)
    return [f"{name}: {a!r} there, {b!r} now" for name, a, b in found]


@dataclass
class ChunkOutput:
    """What one chunk adds: rows, rejects and its counts."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    replies: int = 0
    generated_tokens: int = 0
    supervised_tokens: int = 0
    finish_length: int = 0


def _empty_state(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "world_size": world_size,
        "chunks": 0,
        "rows": 0,
        "rows_bytes": 0,
        "rejects_bytes": 0,
        "replies": 0,
        "generated_tokens": 0,
        "supervised_tokens": 0,
        "finish_length": 0,
        "reject_reasons": {},
        "complete": False,
    }


class OnPolicyWriter:
    """This rank's rows, rejects and state files; holds the rank lock while open.

    Raises (open):
        Busy: another live process writes this rank.
        IncompatibleCache: a rows or rejects file is shorter than its committed length (damaged).
    """

    def __init__(self, root: Path, rank: int, world_size: int) -> None:
        self.root = root
        self.rows_path = root / rows_file(rank, world_size)
        self.rejects_path = root / rejects_file(rank, world_size)
        self.state_path = root / state_file(rank, world_size)
        self.state = _empty_state(rank, world_size)
        self._lock = RankLock(
            root / f"{WRITER_LOCK_PREFIX}{_rank_tag(rank, world_size)}", f"{self.rows_path}"
        )

    def open(self) -> OnPolicyWriter:
        self._lock.acquire()
        try:
            if self.state_path.exists():
                try:
                    self.state = json.loads(self.state_path.read_text(encoding="utf-8"))
                except ValueError:
                    raise IncompatibleCache(
                        f"{self.state_path} is damaged; use a new output directory"
                    ) from None
            self._truncate(self.rows_path, self.state["rows_bytes"])
            self._truncate(self.rejects_path, self.state["rejects_bytes"])
        except BaseException:
            self._lock.release()
            raise
        return self

    def _truncate(self, path: Path, length: int) -> None:
        """Cut `path` back to its committed `length` (creating it empty when absent and nothing is committed)."""
        size = path.stat().st_size if path.exists() else 0
        if size < length:
            raise IncompatibleCache(
                f"{path} holds {size} bytes but {length} are committed (damaged); use a new output directory"
            )
        if path.exists() and size == length:
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(path.parent)

    @property
    def chunks_done(self) -> int:
        return int(self.state["chunks"])

    @property
    def complete(self) -> bool:
        return bool(self.state["complete"])

    def commit(self, chunk: ChunkOutput) -> None:
        """Append the chunk's rows and rejects (fsynced), then record them in the state file atomically."""
        rows = b"".join(encode_line(r) for r in chunk.rows)
        rejects = b"".join(encode_line(r) for r in chunk.rejects)
        self._append(self.rows_path, rows)
        self._append(self.rejects_path, rejects)
        pause_for_crash_test(SLEEP_ENV)
        st = dict(self.state)
        st["chunks"] += 1
        st["rows"] += len(chunk.rows)
        st["rows_bytes"] += len(rows)
        st["rejects_bytes"] += len(rejects)
        st["replies"] += chunk.replies
        st["generated_tokens"] += chunk.generated_tokens
        st["supervised_tokens"] += chunk.supervised_tokens
        st["finish_length"] += chunk.finish_length
        reasons = collections.Counter(st["reject_reasons"])
        reasons.update(r["reason"] for r in chunk.rejects)
        st["reject_reasons"] = dict(sorted(reasons.items()))
        atomic_write_json(self.state_path, st)
        self.state = st

    def _append(self, path: Path, data: bytes) -> None:
        if not data:
            return
        try:
            with open(path, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise_if_no_space(err, str(path))

    def finish(self) -> None:
        """Mark this rank complete (a re-run then has nothing to do)."""
        self.state = {**self.state, "complete": True}
        atomic_write_json(self.state_path, self.state)

    def close(self) -> None:
        self._lock.release()


# ------------------------------------------------------------------------------------------------ reading
def committed_rows_files(path: Path) -> list[tuple[Path, int]]:
    """(rows file, committed byte length) of every rank of a `generate` output, in rank order.

    Raises:
        BadInput: a rank is missing or has not finished (its state file is the only truth about what is
            committed, so an unfinished output would read differently later).
    """
    states = sorted(path.glob("state-rank*.json"))
    if not states:
        raise BadInput(f"generate output {path} has no committed rank yet: run `generate` to the end first")
    files = []
    for state_path in states:
        state = _read_state(state_path)
        world = int(state.get("world_size", 0) or 0)
        if world != len(states):
            raise BadInput(f"generate output {path}: {len(states)} of {world} ranks present; finish them all")
        if not state.get("complete"):
            raise BadInput(
                f"generate output {path}: rank {state.get('rank')} is not complete "
                f"({state.get('rows', 0)} rows committed); re-run the same `generate` to finish it"
            )
        rows = state_path.with_name(state_path.name.replace("state-", "rows-", 1)).with_suffix(".jsonl")
        files.append((rows, int(state.get("rows_bytes", 0))))
    return files


def _read_state(path: Path) -> dict[str, Any]:
    """A state file as a dataset reader sees it (BadInput when unreadable; {} when not a JSON object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BadInput(f"cannot read {path}: {err}") from None
    return data if isinstance(data, dict) else {}
