"""Fuzzing the input side: whatever bytes or JSON a data file holds, `data.formats.iter_rows` yields only
`Conversation` / `Reject` (or raises a `PeagleError`), and `data.chat.ChatRenderer.render` returns a consistent
`RenderedSample` or raises `RejectRow`, never any other exception. Hypothesis, bounded to well under a minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import build_tokenizer

from peagle_pipeline.data.chat import ChatRenderer, RejectRow, RenderedSample
from peagle_pipeline.data.formats import iter_rows
from peagle_pipeline.data.records import Conversation, Message, Reject, to_conversation
from peagle_pipeline.errors import PeagleError

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

ROLES = [
    "system",
    "user",
    "assistant",
    "human",
    "gpt",
    "chatgpt",
    "bing",
    "bard",
    "robot",
    "",
    "USER",
    " gpt ",
]
# JSON values of any shape, with the keys and role names the readers look for mixed in.
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
keys = st.sampled_from(
    ["conversations", "messages", "from", "value", "role", "content", "type", "text"]
) | st.text(max_size=8)
json_values = st.recursive(
    scalars | st.sampled_from(ROLES),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)
turn = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(ROLES) | scalars,
        "from": st.sampled_from(ROLES),
        "content": st.text(max_size=30) | scalars | st.lists(st.text(max_size=5) | json_values, max_size=3),
        "value": st.text(max_size=30),
    },
)
records = (
    st.fixed_dictionaries(
        {},
        optional={
            "messages": st.lists(turn, max_size=5) | json_values,
            "conversations": st.lists(turn, max_size=5),
        },
    )
    | json_values
)


def _check_rows(rows: list[object], source: Path) -> None:
    for row in rows:
        assert isinstance(row, (Conversation, Reject)), row
        assert row.source == str(source)
        if isinstance(row, Reject):
            assert row.reason and "\n" not in row.reason
        else:
            assert row.messages and all(isinstance(m.content, str) for m in row.messages)
            assert any(m.role == "assistant" for m in row.messages)


def _read(path: Path) -> list[object]:
    try:
        return list(iter_rows([path]))
    except PeagleError:
        return []


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-formats")


@FAST
@given(record=records)
def test_to_conversation_accepts_or_rejects_any_json(record: object) -> None:
    row = to_conversation(record, "fuzz.jsonl", 3)
    _check_rows([row], Path("fuzz.jsonl"))
    assert row.source_row == 3


@FAST
@given(blob=st.binary(max_size=300), suffix=st.sampled_from([".json", ".jsonl"]))
def test_iter_rows_on_arbitrary_bytes(scratch: Path, blob: bytes, suffix: str) -> None:
    path = scratch / f"data{suffix}"
    path.write_bytes(blob)
    _check_rows(_read(path), path)


@FAST
@given(
    items=st.lists(records, max_size=5),
    cut=st.integers(0, 400),
    junk=st.binary(max_size=8),
    kind=st.sampled_from(["array", "jsonl", "concat"]),
)
def test_iter_rows_on_damaged_json_documents(
    scratch: Path, items: list[object], cut: int, junk: bytes, kind: str
) -> None:
    """Valid documents cut at a random byte, with random bytes spliced in: rows or rejects, in order."""
    if kind == "array":
        text, suffix = json.dumps(items), ".json"
    elif kind == "jsonl":
        text, suffix = "\n".join(json.dumps(i) for i in items), ".jsonl"
    else:
        text, suffix = " ".join(json.dumps(i) for i in items), ".json"
    data = text.encode()
    data = data[: cut % (len(data) + 1)] + junk + data[cut % (len(data) + 1) :]
    path = scratch / f"doc{suffix}"
    path.write_bytes(data)
    rows = _read(path)
    _check_rows(rows, path)
    assert [r.source_row for r in rows] == sorted(r.source_row for r in rows)
    ambiguous = kind == "concat" and bool(items) and isinstance(items[0], list)  # reads as one array
    if not junk and cut >= len(data) and not ambiguous:  # intact document: one row per record
        assert len(rows) == len(items)


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> ChatRenderer:
    return ChatRenderer(build_tokenizer(tmp_path_factory.mktemp("fuzz-tok"), "chatml"))


texts = st.text(max_size=40) | st.sampled_from(
    ["<|im_end|>", "<|im_start|>assistant\n", "<pad>", " ", "\n", ""]
)


@FAST
@given(
    msgs=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), texts), max_size=6),
    turns=st.sampled_from(["all", "last"]),
    leading=st.sampled_from(["context", "drop"]),
)
def test_renderer_returns_a_sample_or_rejects(
    tmp_path_factory, renderer: ChatRenderer, msgs: list[tuple[str, str]], turns: str, leading: str
) -> None:
    r = ChatRenderer(renderer.tokenizer, turns, leading)  # type: ignore[arg-type]
    try:
        out = r.render([Message(role, content) for role, content in msgs])  # type: ignore[arg-type]
    except RejectRow as err:
        assert err.reason and "\n" not in err.reason
        return
    assert isinstance(out, RenderedSample)
    assert len(out.input_ids) == len(out.loss_mask) and any(out.loss_mask)
    assert all(0 <= t < len(r.tokenizer) for t in out.input_ids)
