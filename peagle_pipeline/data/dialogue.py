"""Prompts for regenerating a conversation's assistant replies, kept as token ids.

Turn j is prompted with the conversation so far in which the earlier replies are the target's *own* generated
ones, rendered the way the template renders an earlier reply (as vLLM renders the conversation when it serves
turn j). Generated ids are never re-tokenised: after a reply, only the template text that follows it (the
separator after its end-of-turn token, the next user turn, the generation prompt) is tokenised and appended.
A reasoning reply ("<think>...</think>" then the answer, Qwen3; harmony's analysis then final channel, gpt-oss:
data/reasoning.py) is given to the template without its thinking (`thinking="strip"`, as clients send replies back
and as these templates render earlier turns anyway) or whole (`"keep"`, the template decides); where the template
writes only the answer, the reply's ids in later prompts are its generated ids from the answer on. The newest
reply of a row is kept whole, as generated. A template that writes an earlier reply as other text than those ids
decode to (it rewrites earlier turns) ends the conversation with a recorded reason. Pure given a tokenizer: no file
I/O, no model, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from peagle_pipeline.data.chat import EMPTY_REPLY, ChatRenderer, RejectRow
from peagle_pipeline.data.reasoning import reply_parts, uses_harmony
from peagle_pipeline.data.records import Conversation, TokenizedConversation

__all__ = [
    "Dialogue",
    "DialogueBuilder",
    "template_end_of_turn_ids",
    "REASON_TOO_LONG",
    "REASON_EMPTY",
    "REASON_LENGTH",
    "REASON_NOT_PREFIX_STABLE",
    "REASON_REWRITES_REPLY",
    "REASON_NO_ANSWER",
    "REASON_TOKEN_IDS",
]

# Why a conversation stopped early (one fixed line each, so the summary can count them).
REASON_TOO_LONG = "prompt longer than max_prompt_tokens"
REASON_EMPTY = EMPTY_REPLY  # the same rule as extract's (data/chat.py)
REASON_LENGTH = "reply hit max_new_tokens"
REASON_NOT_PREFIX_STABLE = "chat template is not prefix-stable (it rewrites earlier turns)"
REASON_REWRITES_REPLY = "chat template rewrites the generated reply text"
REASON_NO_ANSWER = "reply has no final channel (harmony): nothing to give back as an earlier turn"
# A row of token ids (a cache's rows, `generate`'s own output): there are no messages to prompt the target with.
REASON_TOKEN_IDS = "token ids, not chat messages: generate prompts with the messages' text"


class _Next(NamedTuple):
    """How a conversation goes on after a reply (`DialogueBuilder._continuation`).

    start: the row's ids kept before the reply (fewer than the prompt's when the template drops its end).
    kept: the reply's ids as the template writes it as an earlier turn, without its closing token.
    delta: the template's text between those ids and the next reply.
    text: the next prompt's text.
    stop_written: the generated stop token is the template's closing token.
    """

    start: int
    kept: list[int]
    delta: str
    text: str
    stop_written: bool


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
    # The row kept when the conversation ends here: ids, mask and messages up to the newest reply, as generated
    # (the working `input_ids` may hold that reply rewritten as an earlier turn, without its thinking).
    kept: tuple[list[int], list[int], list[dict[str, str]]] | None = None

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
        """The kept row (docs/guides/generate.md): messages and ids up to the last generated reply."""
        if self.turn == 0 or self.kept is None:
            raise ValueError("no reply was generated for this dialogue")
        ids, mask, messages = self.kept
        return {
            "id": f"{self.source_row}-{self.sample}",
            "source": self.source,
            "source_row": self.source_row,
            "sample": self.sample,
            "messages": [dict(m) for m in messages],
            "input_ids": list(ids),
            "loss_mask": list(mask),
            "finish": list(self.finish),
        }


def template_end_of_turn_ids(renderer: ChatRenderer, earlier: bool = False) -> list[int]:
    """The special token(s) the chat template closes an assistant reply with (`<|im_end|>`, `<|eot_id|>`, ...):
    the newest reply's, or with `earlier` an earlier reply's (they differ in gpt-oss's: `<|return|>`, `<|end|>`).

    Found by rendering a conversation and taking the first special token after the reply's text; empty when the
    template closes replies without a special token.
    """
    tok = renderer.tokenizer
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Peagle reply"}]
    if earlier:
        msgs.append({"role": "user", "content": "Bye"})
    try:
        text = renderer.render_text(msgs, generation_prompt=earlier)
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
        thinking: how an earlier reply with reasoning is given to the template for the later turns: "strip"
            (without it, see `data.reasoning.reply_parts`) or "keep" (whole; the template may still drop it, as
            Qwen3's and gpt-oss's do).
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        turns: Literal["all", "first", "last"],
        stop_token_ids: Iterable[int],
        thinking: Literal["strip", "keep"] = "strip",
    ) -> None:
        if turns not in ("all", "first", "last"):
            raise ValueError(f"turns must be all, first or last, got {turns!r}")
        if thinking not in ("strip", "keep"):
            raise ValueError(f"thinking must be strip or keep, got {thinking!r}")
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.turns = turns
        self.thinking = thinking
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self.harmony = uses_harmony(self.tokenizer)
        self._earlier_end_ids = frozenset(template_end_of_turn_ids(renderer, earlier=True))
        self._stop_text = {i: self._decode([i]) for i in self.stop_token_ids}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        """The text the ids spell, as written: no clean-up of the spaces before punctuation (a tokenizer setting,
        Llama 3's among others, that would change the model's reply)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def start(self, conv: Conversation | TokenizedConversation, index: int, sample: int = 0) -> Dialogue:
        """The dialogue of `conv` with the prompt of its first reply to generate.

        A conversation with no reply after its first user turn that ends with a user turn is a prompt: its reply
        is added as the one to generate.

        Raises:
            RejectRow: a row of token ids (no messages to prompt with: a cache's or `generate`'s own output), no
                user turn, no assistant turn after it (and no trailing user turn to answer), or the template
                refuses the conversation.
        """
        if isinstance(conv, TokenizedConversation):
            raise RejectRow(REASON_TOKEN_IDS)
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
        more replies were due, or when the template cannot continue this conversation from the generated ids.
        """
        stop = finish == "stop" and bool(ids) and ids[-1] in self.stop_token_ids
        body = ids[:-1] if stop else ids
        content = self._decode(body) if body else ""
        if not content.strip():
            d.ended = REASON_EMPTY
            return
        reply_start = len(d.input_ids)
        d.messages[d.slots[d.turn]] = {"role": "assistant", "content": content}
        d.input_ids.extend(ids)
        d.loss_mask.extend([1] * len(ids))
        d.finish.append(finish)
        d.turn += 1
        d.reply_end = len(d.input_ids)
        d.kept = (
            list(d.input_ids),
            list(d.loss_mask),
            [dict(m) for m in d.messages[: d.slots[d.turn - 1] + 1]],
        )
        if d.turn == len(d.slots):
            return
        if finish == "length":
            d.ended = REASON_LENGTH
            return
        stop_id = ids[-1] if stop else None
        try:
            nxt = self._continuation(d, reply_start, body, content, stop_id)
        except RejectRow as err:
            d.ended = err.reason
            return
        reply, new = self._closed_reply(nxt.kept, self.encode(nxt.delta), stop_id, nxt.stop_written)
        d.input_ids[nxt.start :] = reply + new
        d.loss_mask[nxt.start :] = [1] * len(reply) + [0] * len(new)
        d.reply_end = nxt.start + len(reply)
        d.text = nxt.text

    def _continuation(
        self, d: Dialogue, reply_start: int, body: list[int], content: str, stop_id: int | None
    ) -> _Next:
        """How the just-generated reply (its ids at `reply_start` of `d.input_ids`) continues as an earlier turn.

        Example (ChatML): the prompt text ends "<|im_start|>assistant\\n", the model generated "Hello" +
        <|im_end|>. The next prompt renders that reply as "Hello<|im_end|>\\n"; "Hello" and the generated <|im_end|>
        are already in the ids (not duplicated), so the delta is "\\n" + "<|im_start|>user\\n...<|im_end|>\\n"
        + "<|im_start|>assistant\\n". Qwen3, reply "<think>\\nwhy\\n</think>\\n\\nHello" + <|im_end|>: the next
        prompt holds "Hello<|im_end|>\\n", so the reply's ids become its generated ids after "</think>\\n\\n".
        gpt-oss, reply "<|channel|>analysis<|message|>why<|end|><|start|>assistant<|channel|>final<|message|>Hello" +
        <|return|>: the next prompt holds "<|channel|>final<|message|>Hello<|end|>", so the reply's ids become the
        generated ids from the final channel's header on, and the delta starts with the template's "<|end|>".
        Qwen3 with `enable_thinking` false: the prompt ended "<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n",
        which the template writes for the newest turn only; the earlier reply follows "<|im_start|>assistant\\n"
        directly, so the empty thinking block's ids leave the row (`start`).

        Raises:
            RejectRow: the template rewrites earlier turns, or writes this reply as text its ids do not spell.
        """
        slot, nxt = d.slots[d.turn - 1], d.slots[d.turn]
        reply = reply_parts(content, self.harmony)
        if reply is None:
            raise RejectRow(REASON_NO_ANSWER)
        d.messages[slot] = reply.message(self.thinking == "keep", self.harmony, content)
        following = self.renderer.render_text(d.messages[:nxt], generation_prompt=True)
        if following.startswith(d.text):
            start, at = reply_start, len(d.text)
        else:
            start, at = self._prompt_tail_dropped(d, reply_start, following)
        tail = following[at:]
        kept = body
        if tail.startswith(content) or tail.startswith(content.strip()):  # as generated (templates may trim)
            written = content if tail.startswith(content) else content.strip()
        else:  # the template wrote the answer only (given so, or stripped by the template itself)
            written = reply.written if tail.startswith(reply.written) else reply.written.strip()
            if not written or not tail.startswith(written):
                raise RejectRow(REASON_REWRITES_REPLY)
            kept = self._ids_spelling(body, content, reply.written)
        rest = tail[len(written) :]
        if stop_id is not None:
            # The generated stop token stands for the template's end-of-turn text when they are the same token.
            stop_text = self._stop_text[stop_id]
            k = rest.find(stop_text) if stop_text else -1
            if k >= 0 and not rest[:k].strip():
                return _Next(start, kept, rest[k + len(stop_text) :], following, True)
        return _Next(start, kept, rest, following, False)

    def _prompt_tail_dropped(self, d: Dialogue, reply_start: int, following: str) -> tuple[int, int]:
        """Where the reply starts, in ids and in `following`'s text, when the template writes the end of the
        generation prompt for the newest turn only (Qwen3's empty thinking block with `enable_thinking` false).

        The text before the generation prompt must be unchanged and the dropped text must be whole tokens at the
        end of the prompt's ids; anything else is a template that rewrites earlier turns.

        Raises:
            RejectRow: REASON_NOT_PREFIX_STABLE.
        """
        slot = d.slots[d.turn - 1]
        before = self.renderer.render_text(d.messages[:slot], generation_prompt=False)
        if not (d.text.startswith(before) and following.startswith(before)):
            raise RejectRow(REASON_NOT_PREFIX_STABLE)
        at = len(before)
        while at < len(d.text) and following[at : at + 1] == d.text[at]:
            at += 1  # the generation prompt's part the earlier turn keeps (the role header)
        dropped = d.text[at:]
        for start in range(reply_start - 1, max(reply_start - len(dropped), 0) - 1, -1):
            if self._decode(d.input_ids[start:reply_start]) == dropped:
                return start, at
        raise RejectRow(REASON_NOT_PREFIX_STABLE)

    def _closed_reply(
        self, kept: list[int], delta: list[int], stop_id: int | None, stop_written: bool
    ) -> tuple[list[int], list[int]]:
        """The reply's ids as an earlier turn, closed as the template closes it, and the template ids after them.

        The generated stop token stays where the template writes that token; where it writes another (an eos
        that is not the template's end-of-turn; gpt-oss's <|end|> for an earlier reply, after <|return|> was
        generated), the stop token is left out and the template's own end-of-turn token closes the reply.
        """
        if stop_written and stop_id is not None:  # written implies a stop token was generated
            return [*kept, stop_id], delta
        if delta and delta[0] in self._earlier_end_ids:
            return [*kept, delta[0]], delta[1:]
        return list(kept), delta

    def _ids_spelling(self, body: list[int], content: str, answer: str) -> list[int]:
        """The suffix of the generated ids `body` (which decode to `content`) that decodes to exactly `answer`, a
        suffix of `content`: the thinking's tokens are dropped, the answer's kept as generated.

        Raises:
            RejectRow: no token boundary falls where the answer starts.
        """
        decode = self.tokenizer.decode
        drop = len(content) - len(answer)  # characters of thinking before the answer
        lo, hi = 0, len(body)
        while lo < hi:  # first k whose prefix decodes to at least `drop` characters
            mid = (lo + hi) // 2
            if len(decode(body[:mid], skip_special_tokens=False)) < drop:
                lo = mid + 1
            else:
                hi = mid
        for k in (lo, lo + 1, lo - 1):
            if 0 <= k <= len(body) and decode(body[k:], skip_special_tokens=False) == answer:
                return body[k:]
        raise RejectRow(REASON_REWRITES_REPLY)
