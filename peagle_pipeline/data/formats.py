"""Read chat datasets as a stream of `Row`s (records.py: `Conversation`, `TokenizedConversation` or `Reject`), one per
source row.

Formats: ShareGPT (`conversations: [{from, value}]`) and OpenAI (`messages: [{role, content}]`) records in JSON
(an array or concatenated objects, parsed incrementally), JSONL, Parquet (row-group streaming) and Hugging Face
datasets saved with `save_to_disk` (their Arrow files are read with pyarrow; `datasets` is not needed); of a
DatasetDict only one split is read, `train` unless another is named. A `generate` output directory is read as its
committed rows (its format: `onpolicy_files.py`).
A bad row becomes a `Reject` with a reason; only a missing or unreadable path raises. Never loads a whole file.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from peagle_pipeline.data.onpolicy_files import META_FILE, WRITER_LOCK_PREFIX, committed_rows_files
from peagle_pipeline.data.records import Reject, Row, to_conversation
from peagle_pipeline.errors import BadInput

__all__ = [
    "DEFAULT_SPLIT",
    "iter_rows",
    "iter_json_records",
    "dataset_fingerprint",
    "split_notes",
]
_JSON_SUFFIXES = (".json",)
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_ROW_COLUMNS = ("conversations", "messages", "input_ids", "loss_mask")
_READ_CHUNK = 1 << 20  # bytes per read of the incremental JSON parser
_ARROW_BATCH = 1024  # rows per record batch converted to Python at a time
DEFAULT_SPLIT = "train"  # the split of a DatasetDict read when none is named
_DATASET_DICT = "dataset_dict.json"


def iter_rows(paths: Iterable[str | os.PathLike[str]], split: str | None = None) -> Iterator[Row]:
    """Yield every row of every path, in order, as a `Row` (a Conversation, a TokenizedConversation or a Reject).

    Args:
        paths: data files (.json, .jsonl/.ndjson, .parquet, .arrow) or directories written by
            `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk`.
        split: the split of a DatasetDict to read (None: `DEFAULT_SPLIT`); only a DatasetDict has splits.

    Raises:
        BadInput: a path is missing, unreadable, or of an unsupported kind; a DatasetDict without the split; a
            split named while no path is a DatasetDict (all are checked when called, before anything is read).
    """
    given = [Path(path) for path in paths]
    readers = [(path, _reader_for(path, split)) for path in given]  # every path checked before any is read
    if split is not None and not any(_is_dataset_dict(p) for p in given):
        raise BadInput(
            f"split {split!r} was given, but no data path is a Hugging Face DatasetDict (only those have splits)"
        )
    return _chain(readers)


def split_notes(paths: Iterable[str | os.PathLike[str]], split: str | None = None) -> list[str]:
    """One line per DatasetDict among `paths`, saying which of its splits is read (and which are not)."""
    notes = []
    for path in map(Path, paths):
        if _is_dataset_dict(path):
            chosen = split or DEFAULT_SPLIT
            others = [s for s in _dict_splits(path) if s != chosen]
            rest = f" (not read: {', '.join(others)}; choose with --split)" if others else ""
            notes.append(f"read split {chosen!r} of the Hugging Face DatasetDict {path}{rest}")
    return notes


def _chain(readers: list[tuple[Path, Any]]) -> Iterator[Row]:
    for path, reader in readers:
        yield from reader(path)


# ----------------------------------------------------------------------------------------------- dispatch


def _reader_for(p: Path, split: str | None):  # type: ignore[no-untyped-def]
    if not p.exists():
        raise BadInput(f"data path not found: {p}")
    if p.is_dir():
        if (p / META_FILE).is_file():
            committed_rows_files(p)  # checked now: an unfinished output fails before anything is written
            return _iter_generated_dir
        if _is_dataset_dict(p):
            chosen = _dict_split_dir(p, split)
            return lambda path: _iter_hf_dir(chosen)
        if (p / "state.json").is_file() or list(p.glob("*.arrow")):
            return _iter_hf_dir
        raise BadInput(
            f"data directory {p} is neither a `generate` output nor a Hugging Face dataset saved with save_to_disk"
        )
    if not os.access(p, os.R_OK):
        raise BadInput(f"data file not readable: {p}")
    suffix = p.suffix.lower()
    if suffix in _JSON_SUFFIXES:
        return _iter_json
    if suffix in _JSONL_SUFFIXES:
        return _iter_jsonl
    if suffix in _PARQUET_SUFFIXES:
        return _iter_parquet
    if suffix == ".arrow":
        return lambda path: _iter_arrow_files([path], str(path))
    raise BadInput(
        f"unsupported data file {p}: expected .json, .jsonl, .parquet, .arrow or a save_to_disk directory"
    )


# ------------------------------------------------------------------------------------------------- JSONL


def _iter_jsonl(path: Path, length: int | None = None) -> Iterator[Row]:
    """One row per non-blank line; `source_row` is the 0-based line index. `length`: read only that many bytes."""
    source = str(path)
    with _open_binary(path) as f:
        lines = f if length is None else io.BytesIO(f.read(length))
        for row, raw in enumerate(lines):
            if row == 0 and raw.startswith(codecs.BOM_UTF8):  # Windows editors prepend one
                raw = raw[len(codecs.BOM_UTF8) :]
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Reject(source, row, f"non-UTF-8 bytes at byte {err.start} of line {row + 1}")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield Reject(source, row, f"malformed JSON on line {row + 1}: {err.msg} (column {err.colno})")
                continue
            yield to_conversation(record, source, row)


def _iter_generated_dir(path: Path) -> Iterator[Row]:
    """A `generate` output: the committed rows of every rank in rank order; `source_row` counts on."""
    offset = 0
    for file, length in committed_rows_files(path):
        last = -1
        for item in _iter_jsonl(file, length):
            last = item.source_row
            yield dataclasses.replace(item, source=str(path), source_row=offset + item.source_row)
        offset += last + 1


# -------------------------------------------------------------------------------------------------- JSON


def _iter_json(path: Path) -> Iterator[Row]:
    source = str(path)
    for item in iter_json_records(path):
        yield item if isinstance(item, Reject) else to_conversation(item[1], source, item[0])


def iter_json_records(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any] | Reject]:
    """Raw records of a JSON file (an array, a single object, or concatenated objects), parsed incrementally.

    Yields `(row, record)` for every complete record. Memory stays at about one record plus one read chunk.
    A file cut mid-record ends with one Reject naming the truncation; a syntax error yields one Reject and
    ends the file (a JSON array cannot be resynchronised reliably).

    Raises:
        BadInput: the file cannot be opened.
    """
    source = str(path)
    stream = _JsonStream(Path(path))
    first = stream.peek()
    if first is None:
        return
    in_array = first == "["
    if in_array:
        stream.advance(1)
    row = 0
    while True:
        ch = stream.peek()
        if ch is None:
            if in_array:
                yield Reject(
                    source, row, f"truncated JSON: file ends after {row} complete records (no closing ']')"
                )
            return
        if in_array and ch == "]":
            return
        outcome = stream.decode()
        if isinstance(outcome, _Truncated):
            yield Reject(
                source, row, f"truncated JSON: file ends inside record {row} (after {row} complete records)"
            )
            return
        if isinstance(outcome, json.JSONDecodeError):
            yield Reject(source, row, f"malformed JSON in record {row}: {outcome.msg}; rest of file skipped")
            return
        # Undecodable bytes became lone surrogates; to_conversation rejects them as non-UTF-8.
        yield row, outcome
        row += 1
        if in_array:
            sep = stream.peek()
            if sep == ",":
                stream.advance(1)
            elif sep not in ("]", None):
                yield Reject(
                    source,
                    row,
                    f"malformed JSON after record {row - 1}: expected ',' or ']'; rest of file skipped",
                )
                return


class _Truncated:
    """Marker: the input ended inside a value."""


class _JsonStream:
    """A text buffer over a binary file, decoded incrementally; values are parsed with `raw_decode`."""

    def __init__(self, path: Path) -> None:
        self._file = _open_binary(path)
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="surrogateescape")  # drops a BOM
        self._json = json.JSONDecoder()
        self._buf = ""
        self._pos = 0
        self._eof = False

    def _fill(self) -> bool:
        """Read one more chunk; False at end of file."""
        if self._eof:
            return False
        data = self._file.read(_READ_CHUNK)
        final = not data
        text = self._decoder.decode(data, final=final)
        self._buf = self._buf[self._pos :] + text  # compact only when reading, so consumed text is dropped
        self._pos = 0
        if final:
            self._eof = True
            self._file.close()
        return not final or bool(text)

    def peek(self) -> str | None:
        """The next non-whitespace character (consumes the whitespace), or None at end of input."""
        while True:
            buf, n = self._buf, len(self._buf)
            pos = self._pos
            while pos < n and buf[pos] in " \t\r\n":
                pos += 1
            self._pos = pos
            if pos < n:
                return buf[pos]
            if not self._fill():
                return None

    def advance(self, n: int) -> None:
        self._pos += n

    def decode(self) -> Any:
        """Parse one value at the cursor; returns it, a JSONDecodeError, or _Truncated at end of input."""
        while True:
            try:
                value, end = self._json.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as err:
                # An error at the end of the buffer (or an unterminated string) may just need more data.
                if self._eof:
                    return _Truncated() if _looks_truncated(err, len(self._buf)) else err
                if _looks_truncated(err, len(self._buf)):
                    self._fill()
                    continue
                return err
            if end == len(self._buf) and not self._eof and isinstance(value, (int, float)):
                self._fill()  # a number at the buffer's end may continue in the next chunk
                continue
            self._pos = end
            return value


def _looks_truncated(err: json.JSONDecodeError, length: int) -> bool:
    return err.pos >= length - 1 or err.msg.startswith("Unterminated string")


# -------------------------------------------------------------------------------------- Parquet and Arrow


def _iter_parquet(path: Path) -> Iterator[Row]:
    """Stream a Parquet file by record batches, reading only the conversation columns."""
    import pyarrow.parquet as pq

    source = str(path)
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as err:  # pyarrow raises several types for a bad file
        raise BadInput(f"cannot read Parquet file {path}: {str(err).splitlines()[0]}") from None
    names = pf.schema_arrow.names
    columns = [c for c in _ROW_COLUMNS if c in names]
    if not columns:
        reason = f"wrong schema: no 'conversations' (ShareGPT) or 'messages' (OpenAI) column; columns: {names[:10]}"
        for row in range(pf.metadata.num_rows):
            yield Reject(source, row, reason)
        return
    yield from _iter_batches(pf.iter_batches(batch_size=_ARROW_BATCH, columns=columns), source, 0)


def _is_dataset_dict(path: Path) -> bool:
    return path.is_dir() and (path / _DATASET_DICT).is_file() and not (path / META_FILE).is_file()


def _dict_splits(path: Path) -> list[str]:
    """The split names of the DatasetDict at `path` (its dataset_dict.json, else its sub-directories)."""
    splits = _read_json_file(path / _DATASET_DICT).get("splits")
    if not isinstance(splits, list) or not splits:
        splits = sorted(d.name for d in path.iterdir() if d.is_dir())
    return [str(s) for s in splits]


def _dict_split_dir(path: Path, split: str | None) -> Path:
    """The directory of split `split` (None: `DEFAULT_SPLIT`) of the DatasetDict at `path`.

    Raises:
        BadInput: the DatasetDict has no such split.
    """
    chosen = split or DEFAULT_SPLIT
    splits = _dict_splits(path)
    if chosen not in splits or not (path / chosen).is_dir():
        raise BadInput(
            f"the Hugging Face DatasetDict {path} has no split {chosen!r} (it has {', '.join(splits) or 'none'}); "
            "choose one with --split"
        )
    return path / chosen


def _iter_hf_dir(path: Path) -> Iterator[Row]:
    """A single Dataset's `save_to_disk` directory (a DatasetDict's split is one)."""
    state_file = path / "state.json"
    if state_file.is_file():
        files = [path / f["filename"] for f in _read_json_file(state_file).get("_data_files", [])]
    else:
        files = []
    if not files:
        files = sorted(path.glob("*.arrow"))
    if not files:
        raise BadInput(f"HF dataset directory {path} holds no .arrow data files")
    yield from _iter_arrow_files(files, str(path))


def _iter_arrow_files(files: list[Path], source: str) -> Iterator[Row]:
    """Rows of Arrow IPC files (stream format as `save_to_disk` writes, or file format); rows count on across files."""
    import pyarrow as pa

    row = 0
    for file in files:
        try:
            source_file = pa.memory_map(str(file), "r")
            try:
                reader = pa.ipc.open_stream(source_file)
                batches: Iterable[Any] = reader
            except pa.ArrowInvalid:
                source_file.seek(0)
                freader = pa.ipc.open_file(source_file)
                batches = (freader.get_batch(i) for i in range(freader.num_record_batches))
        except (OSError, pa.ArrowInvalid) as err:
            raise BadInput(f"cannot read Arrow file {file}: {str(err).splitlines()[0]}") from None
        for item in _iter_batches(batches, source, row):
            yield item
            row = item.source_row + 1


def _iter_batches(batches: Iterable[Any], source: str, row: int) -> Iterator[Row]:
    for batch in batches:
        names = batch.schema.names
        cols = {c: batch.column(names.index(c)).to_pylist() for c in _ROW_COLUMNS if c in names}
        for i in range(batch.num_rows):
            record = {c: values[i] for c, values in cols.items()}
            if not cols:
                record = {"columns": names}
            yield to_conversation(record, source, row)
            row += 1


# --------------------------------------------------------------------------------------------- utilities


def _open_binary(path: Path):  # type: ignore[no-untyped-def]
    try:
        return open(path, "rb")  # noqa: SIM115 - closed by the caller / stream
    except OSError as err:
        raise BadInput(f"cannot open data file {path}: {err.strerror}") from None


def _read_json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BadInput(f"cannot read {path}: {err}") from None
    return data if isinstance(data, dict) else {}


def dataset_fingerprint(paths: Iterable[str | os.PathLike[str]], split: str | None = None) -> str:
    """A cheap identity of the input data: file names, sizes and a hash of each file's first and last MiB.

    Directories (HF datasets, `generate` outputs) contribute every file under them, in sorted order, except the
    lock files a running writer holds (`.peagle-lock-*`: they hold a process id, not data); a DatasetDict only the
    files of the split that is read (`split`, None: `DEFAULT_SPLIT`), and that split's name.

    Raises:
        BadInput: a path does not exist.
    """
    h = hashlib.sha256()
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise BadInput(f"data path not found: {p}")
        read = p
        if _is_dataset_dict(p):
            read = p / (split or DEFAULT_SPLIT)
            h.update(f"split\0{read.name}\0".encode())
        files = (
            sorted(f for f in read.rglob("*") if f.is_file() and not f.name.startswith(WRITER_LOCK_PREFIX))
            if read.is_dir()
            else [read]
            if read.exists()
            else []
        )
        h.update(f"{p.name}\0{len(files)}\0".encode())
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.relative_to(p) if p.is_dir() else f.name}\0{size}\0".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                if size > 1 << 20:
                    fh.seek(max(1 << 20, size - (1 << 20)))
                    h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]
