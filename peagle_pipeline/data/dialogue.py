"""Prompts for regenerating a conversation's assistant replies, kept as token ids (SPEC section 4a).

Turn j is prompted with the conversation so far in which the earlier replies are the target's *own* generated
ones. Generated ids are never re-tokenised: after a reply, only the template text that follows it (the
separator after its end-of-turn token, the next user turn, the generation prompt) is tokenised and appended. That
text is the difference of two `apply_chat_template` renderings, and a template whose renderings are not prefixes
of one another (it rewrites earlier turns) ends the conversation with a recorded reason.
Pure given a tokenizer: no file I/O, no model, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from peagle_pipeline.data.chat import EMPTY_REPLY, ChatRenderer, RejectRow
from peagle_pipeline.data.records import Conversation

__all__ = [
    "Dialogue",
    "DialogueBuilder",
    "template_end_of_turn_ids",
    "REASON_TOO_LONG",
    "REASON_EMPTY",
    "REASON_LENGTH",
    "REASON_NOT_PREFIX_STABLE",
    "REASON_REWRITES_REPLY",
]

# Why a conversation stopped early (one fixed line each, so the summary can count them).
REASON_TOO_LONG = "prompt longer than max_prompt_tokens"
REASON_EMPTY = EMPTY_REPLY  # the same rule as extract's (data/chat.py)
REASON_LENGTH = "reply hit max_new_tokens"
REASON_NOT_PREFIX_STABLE = "chat template is not prefix-stable (it rewrites earlier turns)"
REASON_REWRITES_REPLY = "chat template rewrites the generated reply text"


@dataclass
class Dialogue:
    """One conversation being regenerated: one source row and one sample index.

    `input_ids` always ends with the prompt of the next reply (while active); `reply_end` is where the last
    generated reply ends, i.e. the length of the row that is kept.
    """

    index: int
    source: str
    source_row: int
    sample: int
    messages: list[dict[str, str]]
    slots: list[int]
    input_ids: list[int]
    text: str
    loss_mask: list[int] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    turn: int = 0
    reply_end: int = 0
    ended: str | None = None

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [0] * len(self.input_ids)

    @property
    def active(self) -> bool:
        """Another reply is to be generated."""
        return self.ended is None and self.turn < len(self.slots)

    @property
    def dropped_turns(self) -> int:
        """Replies that were to be generated but were not (the conversation ended early)."""
        return len(self.slots) - self.turn

    def to_row(self) -> dict[str, Any]:
        """The kept row (the contract of docs/generate.md): messages and ids up to the last generated reply."""
        if self.turn == 0:
            raise ValueError("no reply was generated for this dialogue")
        last = self.slots[self.turn - 1]
        return {
            "id": f"{self.source_row}-{self.sample}",
            "source": self.source,
            "source_row": self.source_row,
            "sample": self.sample,
            "messages": [dict(m) for m in self.messages[: last + 1]],
            "input_ids": self.input_ids[: self.reply_end],
            "loss_mask": self.loss_mask[: self.reply_end],
            "finish": list(self.finish),
        }


def template_end_of_turn_ids(renderer: ChatRenderer) -> list[int]:
    """The special token(s) the chat template closes an assistant reply with (`<|im_end|>`, `<|eot_id|>`, ...).

    Found by rendering a one-turn conversation and taking the first special token after the reply's text;
    empty when the template closes replies without a special token.
    """
    tok = renderer.tokenizer
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Peagle reply"}]
    try:
        text = renderer.render_text(msgs, generation_prompt=False)
    except RejectRow:
        return []
    at = text.rfind("Peagle reply")
    if at < 0:
        return []
    rest = text[at + len("Peagle reply") :]
    ids = tok(rest, add_special_tokens=False)["input_ids"]
    return [i for i in ids if i in renderer.special_ids][:1]


class DialogueBuilder:
    """Starts dialogues from source conversations and extends them reply by reply.

    Args:
        renderer: the target's chat renderer (its tokenizer and template).
        turns: "all" regenerates every assistant reply after the first user turn, each prompted with the
            earlier *generated* replies; "first" only the first reply; "last" only the last one, prompted with
            the original earlier replies (kept as unsupervised context).
        stop_token_ids: the ids that end a reply (the template's end-of-turn and the model's eos).
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        turns: Literal["all", "first", "last"],
        stop_token_ids: Iterable[int],
    ) -> None:
        if turns not in ("all", "first", "last"):
            raise ValueError(f"turns must be all, first or last, got {turns!r}")
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.turns = turns
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self._stop_text = {i: self.tokenizer.decode([i]) for i in self.stop_token_ids}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, conv: Conversation, index: int, sample: int = 0) -> Dialogue:
        """The dialogue of `conv` with the prompt of its first reply to generate.

        A conversation with no reply after its first user turn that ends with a user turn is a prompt: its reply
        is added as the one to generate.

        Raises:
            RejectRow: no user turn, no assistant turn after it (and no trailing user turn to answer), or the
                template refuses the conversation.
        """
        msgs = [{"role": m.role, "content": m.content} for m in conv.messages]
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if first_user is None:
            raise RejectRow("no user turn")
        slots = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > first_user]
        if not slots and msgs[-1]["role"] == "user":
            msgs.append({"role": "assistant", "content": ""})
            slots = [len(msgs) - 1]
        if not slots:
            raise RejectRow("no assistant turn after the first user turn")
        if self.turns == "first":
            slots = slots[:1]
        elif self.turns == "last":
            slots = slots[-1:]
        text = self.renderer.render_text(msgs[: slots[0]], generation_prompt=True)
        return Dialogue(index, conv.source, conv.source_row, sample, msgs, slots, self.encode(text), text)

    def fork(self, d: Dialogue, sample: int) -> Dialogue:
        """A fresh copy of a just-started dialogue for another sample index."""
        return Dialogue(
            d.index,
            d.source,
            d.source_row,
            sample,
            [dict(m) for m in d.messages],
            list(d.slots),
            list(d.input_ids),
            d.text,
        )

    def add_reply(self, d: Dialogue, ids: list[int], finish: Literal["stop", "length"]) -> None:
        """Append a generated reply (its ids end with a stop id when finish is "stop") and the next prompt.

        Sets `d.ended` instead when the reply is empty (it is not kept), when it hit the token limit while
        more replies were due, or when the template cannot continue this conversation prefix-stably.
        """
        stop = finish == "stop" and bool(ids) and ids[-1] in self.stop_token_ids
        body = ids[:-1] if stop else ids
        content = self.tokenizer.decode(body, skip_special_tokens=False) if body else ""
        if not content.strip():
            d.ended = REASON_EMPTY
            return
        d.messages[d.slots[d.turn]] = {"role": "assistant", "content": content}
        d.input_ids.extend(ids)
        d.loss_mask.extend([1] * len(ids))
        d.finish.append(finish)
        d.turn += 1
        d.reply_end = len(d.input_ids)
        if d.turn == len(d.slots):
            return
        if finish == "length":
            d.ended = REASON_LENGTH
            return
        try:
            delta, text = self._continuation(d, content, ids[-1] if stop else None)
        except RejectRow as err:
            d.ended = err.reason
            return
        new = self.encode(delta)
        d.input_ids.extend(new)
        d.loss_mask.extend([0] * len(new))
        d.text = text

    def _continuation(self, d: Dialogue, content: str, stop_id: int | None) -> tuple[str, str]:
        """Template text between the just-generated reply's last token and the next reply; and the new prompt text.

        Example (ChatML): the prompt text ends "<|im_start|>assistant\\n", the model generated "Hello" +
        <|im_end|>. Rendering that reply gives tail "Hello<|im_end|>\\n"; "Hello" and the generated <|im_end|>
        are already in the ids (not duplicated), so the delta is "\\n" + "<|im_start|>user\\n...<|im_end|>\\n"
        + "<|im_start|>assistant\\n".
        """
        slot, nxt = d.slots[d.turn - 1], d.slots[d.turn]
        rendered = self.renderer.render_text(d.messages[: slot + 1], generation_prompt=False)
        if not rendered.startswith(d.text):
            raise RejectRow(REASON_NOT_PREFIX_STABLE)
        tail = rendered[len(d.text) :]
        if tail.startswith(content):
            rest = tail[len(content) :]
        elif tail.startswith(content.strip()):  # templates that trim the reply
            rest = tail[len(content.strip()) :]
        else:
            raise RejectRow(REASON_REWRITES_REPLY)
        if stop_id is not None:
            # The generated stop token stands for the template's end-of-turn text when they are the same token.
            stop_text = self._stop_text[stop_id]
            k = rest.find(stop_text) if stop_text else -1
            if k >= 0 and not rest[:k].strip():
                rest = rest[k + len(stop_text) :]
        following = self.renderer.render_text(d.messages[:nxt], generation_prompt=True)
        if not following.startswith(rendered):
            raise RejectRow(REASON_NOT_PREFIX_STABLE)
        return rest + following[len(rendered) :], following
