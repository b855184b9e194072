"""One parsed source row, checked and normalised: a `Conversation` (text turns), a `TokenizedConversation` (token ids
and a loss mask kept as generated) or a `Reject` with a one-line reason.

`to_conversation` takes a record as a reader yields it (a dict from JSON, JSONL, Parquet or Arrow) and accepts the
ShareGPT (`conversations: [{from, value}]`) and OpenAI (`messages: [{role, content}]`) schemas, tool calls included.
The readers of files and directories are in `formats.py`. `rank_rows` picks one rank's rows of a stream (the
`extract` and `generate` stages split their data the same way).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Role",
    "ROLE_MAP",
    "Message",
    "Conversation",
    "TokenizedConversation",
    "Reject",
    "Row",
    "to_conversation",
    "rank_rows",
]

Role = Literal["system", "user", "assistant", "tool"]

# Source role names (lower-cased) -> our role. ShareGPT and OpenAI spellings in one table.
ROLE_MAP: dict[str, Role] = {
    "system": "system",
    "developer": "system",  # OpenAI's name for system instructions since o1; its API treats it as system
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "tool": "tool",  # OpenAI tool results (rendered as context, never supervised)
}


# Where an assistant turn keeps its reasoning apart from its content, by convention: `reasoning_content` (DeepSeek's
# API, Qwen3's template, vLLM before 0.10), `reasoning` (vLLM's API now) and `thinking` (gpt-oss's template).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation.

    `tool_calls` (assistant turns) are OpenAI tool calls with their JSON `arguments` parsed into objects, as vLLM
    hands them to chat templates; `tool_call_id` is what a `tool` turn answers. Both go to the chat template as is.
    `reasoning` (assistant turns) is the reply's reasoning when the row keeps it apart from the content (see
    `REASONING_KEYS`); the chat template decides where it goes (Qwen3: a `<think>` block on the newest turn).
    """

    role: Role
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True, slots=True)
class Conversation:
    """A usable source row: `source` is the file (or dataset directory), `source_row` its row index there."""

    source: str
    source_row: int
    messages: list[Message]


@dataclass(frozen=True, slots=True)
class TokenizedConversation:
    """A row that carries its own token ids and loss mask (on-policy data written by `generate`): used as is.

    `input_ids` [T] are the tokens the target saw and produced; `loss_mask` [T] is True on generated reply
    tokens. Re-rendering the text could give other ids than were generated, so none is done.
    """

    source: str
    source_row: int
    input_ids: list[int]
    loss_mask: list[bool]


@dataclass(frozen=True, slots=True)
class Reject:
    """A source row that cannot be used, with a one-line reason."""

    source: str
    source_row: int
    reason: str
    prompt: Conversation | None = None
    """A conversation with no reply at all that ends with a user turn (a prompt): nothing to extract, but
    `generate` writes its reply (drafts are trained on prompts whose replies the target writes)."""


Row = Conversation | TokenizedConversation | Reject
"""One source row as read: usable as text, usable as token ids, or rejected with a reason."""


def most_common_reasons(reasons: Iterable[str], shown: int = 3) -> str:
    """The most frequent reject reasons, for an error line.

    >>> most_common_reasons(["too long", "empty reply", "too long"])
    "2 x 'too long', 1 x 'empty reply'"
    """
    counts = collections.Counter(reasons).most_common()
    top = ", ".join(f"{n} x {reason!r}" for reason, n in counts[:shown])
    return top + (f" and {len(counts) - shown} more reason(s)" if len(counts) > shown else "")


def rank_rows(
    rows: Iterable[Any], rank: int, world_size: int, max_samples: int | None
) -> Iterator[tuple[int, Any]]:
    """(global row index = sample id, row) for this rank: the first max_samples rows, then index % world == rank."""
    for index, row in enumerate(rows):
        if max_samples is not None and index >= max_samples:
            return
        if index % world_size == rank:
            yield index, row


def to_conversation(record: Any, source: str, row: int) -> Conversation | TokenizedConversation | Reject:
    """Validate one parsed record (a dict) and normalise it to a Conversation, or explain why not.

    A record with both `input_ids` and `loss_mask` is a TokenizedConversation (its text, if any, is ignored).
    """

    def reject(reason: str) -> Reject:
        return Reject(source, row, reason)

    if not isinstance(record, dict):
        return reject(f"wrong schema: row is a JSON {type(record).__name__}, expected an object")
    if record.get("input_ids") is not None or record.get("loss_mask") is not None:
        return _to_tokenized(record, source, row)
    if record.get("conversations") is not None:
        turns, key = record["conversations"], "conversations"
    elif record.get("messages") is not None:
        turns, key = record["messages"], "messages"
    else:
        keys = ", ".join(repr(k) for k in sorted(map(str, record)))[:120]  # repr: a reason stays one line
        return reject(
            f"wrong schema: no 'conversations' (ShareGPT) or 'messages' (OpenAI) list; keys: [{keys}]"
        )
    if not isinstance(turns, list):
        return reject(f"wrong schema: '{key}' is a {type(turns).__name__}, expected a list")
    if not turns:
        return reject("empty conversation")
    messages: list[Message] = []
    for i, turn in enumerate(turns):
        message = _to_message(turn, i)
        if isinstance(message, str):
            return reject(message)
        messages.append(message)
    if not any(m.role == "assistant" for m in messages):
        prompt = Conversation(source, row, messages) if messages[-1].role == "user" else None
        return Reject(source, row, "no assistant turn", prompt)
    return Conversation(source, row, messages)


def _to_message(turn: Any, i: int) -> Message | str:
    """Turn `i` of a row as a Message, or why the row is rejected."""
    if not isinstance(turn, dict):
        return f"wrong schema: turn {i} is a {type(turn).__name__}, expected an object"
    role_raw = turn.get("from", turn.get("role"))
    content = turn["value"] if "value" in turn else turn.get("content")
    if not isinstance(role_raw, str):
        return f"wrong schema: turn {i} has no string 'from'/'role'"
    role = ROLE_MAP.get(role_raw.strip().lower())
    if role is None:
        return f"unknown role {role_raw[:40]!r} in turn {i}"
    if turn.get("tool_calls") and role != "assistant":
        return f"tool calls in a {role} turn (turn {i})"
    calls = _tool_calls(turn.get("tool_calls"))
    if isinstance(calls, str):
        return f"malformed tool call in turn {i}: {calls}"
    text = "" if content is None and calls else _content_text(content)  # OpenAI: `content: null` + calls
    if not isinstance(text, str):
        return f"non-string content in turn {i}: {text}"
    if not _is_valid_unicode(text) or not _is_valid_unicode(role_raw):
        return f"non-UTF-8 bytes (or lone surrogates) in turn {i}"
    call_id = turn.get("tool_call_id") if role == "tool" else None
    reasoning = next((turn[k] for k in REASONING_KEYS if turn.get(k) is not None), None)
    if reasoning is not None and (not isinstance(reasoning, str) or not _is_valid_unicode(reasoning)):
        return f"reasoning of turn {i} is not a UTF-8 string"
    return Message(
        role,
        text,
        calls,
        call_id if isinstance(call_id, str) else None,
        reasoning if role == "assistant" and reasoning else None,
    )


def _to_tokenized(record: dict[str, Any], source: str, row: int) -> TokenizedConversation | Reject:
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list):
        return Reject(
            source, row, "wrong schema: a tokenised row needs both 'input_ids' and 'loss_mask' lists"
        )
    if len(ids) != len(mask):
        return Reject(source, row, f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
    if not all(type(i) is int and i >= 0 for i in ids):
        return Reject(source, row, "input_ids must be non-negative integers")
    if not all(m in (0, 1) and type(m) in (int, bool) for m in mask):
        return Reject(source, row, "loss_mask must hold 0/1 (or booleans)")
    if not any(mask):
        return Reject(source, row, "no supervised token (loss_mask is all 0)")
    return TokenizedConversation(source, row, ids, [bool(m) for m in mask])


def _content_text(content: Any) -> str | Exception:
    """The text of a turn: a string, or OpenAI's list of text parts joined; otherwise an error to report."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif (
                isinstance(part, dict)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                return TypeError(f"content part of type {kind!r} is not text")
        return "".join(parts)
    return TypeError(f"got {type(content).__name__}")


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None | str:
    """OpenAI `tool_calls` with string `arguments` parsed (vLLM does the same before templating); a str is why not."""
    if not calls:
        return None
    if not isinstance(calls, list):
        return f"'tool_calls' is a {type(calls).__name__}, expected a list"
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return "a call without a function name"
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _is_valid_unicode(text: str) -> bool:
    # Undecodable bytes arrive as lone surrogates (surrogateescape); they cannot be encoded back to UTF-8.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
