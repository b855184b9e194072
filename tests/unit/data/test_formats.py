"""data.formats: every input format, incremental JSON (truncation), and every reject reason."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from peagle_pipeline.data.formats import dataset_fingerprint, iter_rows
from peagle_pipeline.data.records import Conversation, Message, Reject
from peagle_pipeline.errors import BadInput

SHAREGPT = {
    "id": "a",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "user", "value": "Bye"},
        {"from": "chatgpt", "value": "Bye."},
    ],
}
OPENAI = {
    "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "."}]},
    ]
}
EXPECTED_SHAREGPT = [
    Message("system", "Be brief."),
    Message("user", "Hi"),
    Message("assistant", "Hello!"),
    Message("user", "Bye"),
    Message("assistant", "Bye."),
]


def _rows(path) -> list[Conversation | Reject]:
    return list(iter_rows([str(path)]))


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_jsonl_sharegpt_and_openai(tmp_path):
    rows = _rows(_write_jsonl(tmp_path / "d.jsonl", [SHAREGPT, OPENAI]))
    assert [type(r) for r in rows] == [Conversation, Conversation]
    assert rows[0].messages == EXPECTED_SHAREGPT
    assert rows[1].messages == [Message("user", "2+2?"), Message("assistant", "4.")]
    assert [r.source_row for r in rows] == [0, 1] and rows[0].source == str(tmp_path / "d.jsonl")


@pytest.mark.parametrize("role", ["bing", "bard", "assistant", "GPT"])
def test_assistant_role_aliases(tmp_path, role):
    rec = {"conversations": [{"from": "human", "value": "q"}, {"from": role, "value": "a"}]}
    (row,) = _rows(_write_jsonl(tmp_path / "d.jsonl", [rec]))
    assert row.messages[1] == Message("assistant", "a")


REJECT_CASES = [
    ('{"conversations": [{"from": "human", "value": "x"}', "malformed JSON on line 2"),
    ('{"conversations": []}', "empty conversation"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant turn"),
    (
        '{"conversations": [{"from": "human", "value": "x"}, {"from": "function", "value": "y"}]}',
        "unknown role 'function' in turn 1",  # ('tool' is a role: OpenAI tool results)
    ),
    ('{"text": "plain"}', "wrong schema: no 'conversations'"),
    ("[1, 2]", "wrong schema: row is a JSON list"),
    ('{"conversations": "hello"}', "wrong schema: 'conversations' is a str"),
    (
        '{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "a"}]}',
        "non-string content in turn 0",
    ),
    (
        '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}',
        "non-string content in turn 0",
    ),
    (
        '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "a"}]}',
        "non-string content in turn 0: content part of type 'image_url'",
    ),
]


def test_a_prompt_without_a_reply_is_rejected_for_extract_but_kept_for_generate(tmp_path):
    """No assistant turn: nothing to extract. When the row ends with a user turn it is a prompt, and the reject
    carries it as a conversation, which `generate` answers; a row that does not end with a user turn has none."""
    path = tmp_path / "d.jsonl"
    prompt = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]}
    system_only = {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}
    path.write_text(f"{json.dumps(prompt)}\n{json.dumps(system_only)}\n", encoding="utf-8")
    first, second = _rows(path)
    assert isinstance(first, Reject) and first.reason == "no assistant turn"
    assert first.prompt == Conversation(
        str(path), 0, [Message("system", "be brief"), Message("user", "why?")]
    )
    assert isinstance(second, Reject) and second.reason == "no assistant turn" and second.prompt is None


@pytest.mark.parametrize(("line", "reason"), REJECT_CASES)
def test_jsonl_reject_reasons_one_per_line(tmp_path, line, reason):
    path = tmp_path / "d.jsonl"
    good = json.dumps(SHAREGPT)
    path.write_text(f"{good}\n{line}\n\n{good}\n", encoding="utf-8")
    rows = _rows(path)
    assert [type(r) for r in rows] == [
        Conversation,
        Reject,
        Conversation,
    ]  # one bad line never spoils the file
    assert reason in rows[1].reason
    assert [r.source_row for r in rows] == [0, 1, 3]


def test_jsonl_non_utf8_line(tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps(SHAREGPT).encode()
    path.write_bytes(
        good + b"\n" + b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n' + good + b"\n"
    )
    rows = _rows(path)
    assert isinstance(rows[1], Reject) and "non-UTF-8 bytes" in rows[1].reason
    assert isinstance(rows[0], Conversation) and isinstance(rows[2], Conversation)


def test_json_array_and_single_object(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([SHAREGPT, OPENAI, SHAREGPT], indent=2), encoding="utf-8")
    rows = _rows(arr)
    assert [r.source_row for r in rows] == [0, 1, 2] and all(isinstance(r, Conversation) for r in rows)
    one = tmp_path / "o.json"
    one.write_text(json.dumps(OPENAI), encoding="utf-8")
    (row,) = _rows(one)
    assert row.messages[1].content == "4."
    empty = tmp_path / "e.json"
    empty.write_text(" [ ] ", encoding="utf-8")
    assert _rows(empty) == []


def test_json_array_parsed_incrementally_across_chunks(tmp_path, monkeypatch):
    import peagle_pipeline.data.formats as formats

    monkeypatch.setattr(formats, "_READ_CHUNK", 7)  # records and numbers straddle many reads
    records = [SHAREGPT | {"n": 12345678 + i} for i in range(20)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    rows = _rows(path)
    assert len(rows) == 20 and all(
        isinstance(r, Conversation) and r.messages == EXPECTED_SHAREGPT for r in rows
    )


@pytest.mark.parametrize("cut", [1, 15, 200])
def test_truncated_json_array_yields_complete_records_then_one_reject(tmp_path, cut, monkeypatch):
    import peagle_pipeline.data.formats as formats

    monkeypatch.setattr(formats, "_READ_CHUNK", 64)
    text = json.dumps([SHAREGPT, OPENAI, SHAREGPT])
    last_start = text.rindex('{"id"')
    path = tmp_path / "t.json"
    path.write_text(text[: last_start + cut], encoding="utf-8")
    rows = _rows(path)
    assert [type(r) for r in rows] == [Conversation, Conversation, Reject]
    assert (
        rows[2].source_row == 2
        and "truncated JSON" in rows[2].reason
        and "2 complete records" in rows[2].reason
    )


def test_json_missing_closing_bracket_and_syntax_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([SHAREGPT])[:-1], encoding="utf-8")
    rows = _rows(path)
    assert (
        isinstance(rows[0], Conversation) and isinstance(rows[1], Reject) and "no closing" in rows[1].reason
    )
    bad = tmp_path / "b.json"
    bad.write_text("[" + json.dumps(SHAREGPT) + ', {"conversations": [}, ' + json.dumps(SHAREGPT) + "]")
    rows = _rows(bad)
    assert len(rows) == 2 and isinstance(rows[1], Reject) and "malformed JSON in record 1" in rows[1].reason


def test_json_non_utf8_record_rejected_others_kept(tmp_path):
    path = tmp_path / "n.json"
    good = json.dumps(SHAREGPT).encode()
    bad = b'{"conversations": [{"from": "human", "value": "\xff\xfe"}, {"from": "gpt", "value": "x"}]}'
    path.write_bytes(b"[" + good + b"," + bad + b"," + good + b"]")
    rows = _rows(path)
    assert [type(r) for r in rows] == [Conversation, Reject, Conversation]
    assert "non-UTF-8" in rows[1].reason


def test_parquet_streams_row_groups(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table({"conversations": [SHAREGPT["conversations"]] * 5, "id": list("abcde")})
    pq.write_table(table, path, row_group_size=2)
    rows = _rows(path)
    assert len(rows) == 5 and [r.source_row for r in rows] == list(range(5))
    assert all(r.messages == EXPECTED_SHAREGPT for r in rows)
    other = tmp_path / "o.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), other)
    rows = _rows(other)
    assert len(rows) == 2 and all(isinstance(r, Reject) and "no 'conversations'" in r.reason for r in rows)


def _save_hf_dataset(path: Path, tables: list[pa.Table]) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC *stream* files + state.json + dataset_info.json."""
    path.mkdir(parents=True)
    files = []
    for i, table in enumerate(tables):
        name = f"data-{i:05d}-of-{len(tables):05d}.arrow"
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
        files.append({"filename": name})
    (path / "state.json").write_text(json.dumps({"_data_files": files, "_fingerprint": "x", "_split": None}))
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return path


def test_hf_saved_dataset_and_dataset_dict(tmp_path):
    plain = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
    msgs = pa.table({"messages": [plain] * 3})
    ds = _save_hf_dataset(tmp_path / "ds", [msgs, msgs])
    rows = _rows(ds)
    assert [r.source_row for r in rows] == list(range(6)) and all(isinstance(r, Conversation) for r in rows)
    assert rows[0].source == str(ds) and rows[5].messages[1] == Message("assistant", "4.")
    dd = tmp_path / "dd"
    _save_hf_dataset(dd / "train", [msgs])
    _save_hf_dataset(dd / "test", [pa.table({"conversations": [SHAREGPT["conversations"]]})])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    rows = _rows(dd)  # a DatasetDict: its train split only
    assert [r.source for r in rows] == [str(dd / "train")] * 3
    (row,) = list(iter_rows([dd], split="test"))
    assert row.source == str(dd / "test") and row.messages == EXPECTED_SHAREGPT


def test_bad_paths_raise_bad_input(tmp_path):
    with pytest.raises(BadInput, match="not found"):
        _rows(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(BadInput, match="unsupported"):
        _rows(tmp_path / "x.csv")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(BadInput, match="save_to_disk"):
        _rows(tmp_path / "emptydir")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(BadInput, match="Parquet"):
        _rows(tmp_path / "bad.parquet")


def test_dataset_fingerprint_changes_with_content(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [SHAREGPT])
    fp = dataset_fingerprint([path])
    assert fp == dataset_fingerprint([str(path)]) and len(fp) == 16
    _write_jsonl(path, [OPENAI])
    assert dataset_fingerprint([path]) != fp
    with pytest.raises(BadInput):
        dataset_fingerprint([tmp_path / "nope"])


def test_all_paths_checked_before_reading(tmp_path):
    good = _write_jsonl(tmp_path / "d.jsonl", [SHAREGPT])
    with pytest.raises(BadInput, match="missing.json"):
        iter_rows([good, tmp_path / "missing.json"])  # raises at the call, not after the first file
    rows = list(iter_rows([good, good]))
    assert [r.source_row for r in rows] == [0, 0]


# ---- byte-order marks and odd encodings ------------------------------------------------------------------
def test_utf8_bom_does_not_cost_the_first_conversation(tmp_path):
    bom = b"\xef\xbb\xbf"
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_bytes(bom + (json.dumps(OPENAI) + "\n" + json.dumps(SHAREGPT) + "\n").encode())
    arr = tmp_path / "d.json"
    arr.write_bytes(bom + json.dumps([SHAREGPT, OPENAI]).encode())
    for path in (jsonl, arr):
        rows = _rows(path)
        assert [type(r).__name__ for r in rows] == ["Conversation", "Conversation"], rows
    assert _rows(arr)[0].messages == EXPECTED_SHAREGPT


TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOLS = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny."},
    ]
}


def test_openai_tool_call_turns_are_read(tmp_path):
    """`content: null` with `tool_calls`, and `role: tool`, are kept (arguments parsed as vLLM does)."""
    (row,) = _rows(_write_jsonl(tmp_path / "d.jsonl", [TOOLS]))
    assert isinstance(row, Conversation), row
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert row.messages == [
        Message("user", "Weather in Paris?"),
        Message("assistant", "", tool_calls=[call]),
        Message("tool", "18 C, sunny", tool_call_id="call_1"),
        Message("assistant", "It is 18 C and sunny."),
    ]


@pytest.mark.parametrize(
    ("turn", "reason"),
    [
        ({"role": "assistant", "content": None, "tool_calls": "x"}, "malformed tool call in turn 1"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]},
            "malformed tool call in turn 1",
        ),
        ({"role": "assistant", "content": None}, "non-string content in turn 1"),
        ({"role": "user", "content": None, "tool_calls": [TOOL_CALL]}, "tool calls in a user turn (turn 1)"),
        ({"role": "tool", "content": None}, "non-string content in turn 1"),
    ],
)
def test_bad_tool_call_turns_are_rejected_with_a_reason(tmp_path, turn, reason):
    record = {"messages": [{"role": "user", "content": "hi"}, turn, {"role": "assistant", "content": "ok"}]}
    (row,) = _rows(_write_jsonl(tmp_path / "d.jsonl", [record]))
    assert isinstance(row, Reject) and reason in row.reason, row


def test_dataset_fingerprint_of_a_directory_ignores_a_writers_lock_file(tmp_path):
    """A `generate` output holds `.peagle-lock-*` (a pid, rewritten by every run, even a no-op one): an extraction
    from it must still resume; any other file of the directory still counts."""
    from peagle_pipeline.data.onpolicy_files import WRITER_LOCK_PREFIX

    (tmp_path / "rows-rank00000-of-00001.jsonl").write_text('{"prompt": "x"}\n')
    before = dataset_fingerprint([tmp_path])
    (tmp_path / f"{WRITER_LOCK_PREFIX}rank00000-of-00001").write_text("12345")
    assert dataset_fingerprint([tmp_path]) == before
    (tmp_path / f"{WRITER_LOCK_PREFIX}rank00000-of-00001").write_text("678")
    assert dataset_fingerprint([tmp_path]) == before
    (tmp_path / "state-rank00000-of-00001.json").write_text("{}")
    assert dataset_fingerprint([tmp_path]) != before


# ---- OpenAI's developer role -----------------------------------------------------------------------------
def test_openai_developer_role_is_read_as_system(tmp_path):
    """OpenAI's `developer` role (o1 and later) carries what `system` did; its API takes one for the other."""
    record = {
        "messages": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour."},
        ]
    }
    (row,) = _rows(_write_jsonl(tmp_path / "d.jsonl", [record]))
    assert isinstance(row, Conversation), row
    assert row.messages[0] == Message("system", "Answer in French.")


# ---- Hugging Face DatasetDict splits ---------------------------------------------------------------------
def test_a_dataset_dict_is_read_one_split_at_a_time_and_says_which(tmp_path):
    """All splits in one cache would put the test split in training: `train` by default, another by name, a note
    says which was read, and the fingerprint (what resume compares) is that of the split read."""
    from peagle_pipeline.data.formats import split_notes

    plain = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
    dd = tmp_path / "dd"
    _save_hf_dataset(dd / "train", [pa.table({"messages": [plain] * 3})])
    _save_hf_dataset(dd / "test", [pa.table({"conversations": [SHAREGPT["conversations"]]})])
    _save_hf_dataset(dd / "validation", [pa.table({"messages": [plain] * 2})])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test", "validation"]}))
    assert {r.source for r in iter_rows([dd])} == {str(dd / "train")} and len(list(iter_rows([dd]))) == 3
    assert len(list(iter_rows([dd], split="validation"))) == 2
    assert split_notes([dd]) == [
        f"read split 'train' of the Hugging Face DatasetDict {dd} (not read: test, validation; choose with --split)"
    ]
    assert split_notes([dd], "test")[0].startswith(f"read split 'test' of the Hugging Face DatasetDict {dd}")
    jsonl = _write_jsonl(tmp_path / "d.jsonl", [SHAREGPT])
    assert split_notes([jsonl]) == []
    with pytest.raises(
        BadInput, match=r"has no split 'dev' \(it has train, test, validation\); choose one with --split"
    ):
        iter_rows([dd], split="dev")
    with pytest.raises(BadInput, match="no data path is a Hugging Face DatasetDict"):
        iter_rows([jsonl], split="test")
    train_fp = dataset_fingerprint([dd])
    assert train_fp == dataset_fingerprint([dd], "train") != dataset_fingerprint([dd], "test")
    (dd / "test" / "extra.arrow").write_bytes(b"x")  # a split that is not read does not change the identity
    assert dataset_fingerprint([dd]) == train_fp
    no_train = tmp_path / "nt"
    _save_hf_dataset(no_train / "test", [pa.table({"messages": [plain]})])
    (no_train / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    with pytest.raises(BadInput, match=r"has no split 'train' \(it has test\)"):
        iter_rows([no_train])
