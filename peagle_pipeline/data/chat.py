"""Render a conversation with the target tokenizer's own chat template into token ids and an assistant loss mask.

The mask is derived without `{% generation %}` tags: each assistant reply is located by rendering the
conversation prefix that ends with the generation prompt, so the reply is exactly what the model would generate
after that prompt: the content and the end-of-turn token(s) that follow it (`<|im_end|>`, `<|eot_id|>`, ...),
never role headers, injected system prompts or the separator after the end-of-turn token. An assistant turn with
OpenAI tool calls is passed to the template as is; its reply is the calls as the template renders them plus the
end-of-turn token(s); a template that does not render them rejects the conversation (with that reason). The
whole conversation is rendered once, as the server renders it; a template that writes the newest turn otherwise
(Qwen3's `<think>` block) still has each reply supervised as written in that whole rendering.
Templates that write today's date (Llama 3's "Today Date", gpt-oss's "Current date") get the renderer's clock, fixed
when it is made, so that every rendering of a conversation agrees, past midnight too.
Pure given a tokenizer: no file I/O, no model.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from peagle_pipeline.data.records import Message
from peagle_pipeline.data.template_variables import check_template_kwargs
from peagle_pipeline.errors import BadInput

__all__ = ["ChatRenderer", "RenderedSample", "RejectRow", "template_token_ids", "EMPTY_REPLY"]

EMPTY_REPLY = "empty reply"
"""Why a row has nothing to learn from its replies: they are empty or whitespace only (no tool calls). The one rule for
extract (such a reply is never supervised) and generate (such a generated reply is not kept)."""


# A bounded render first tokenises 16 characters per wanted token (keeping the tokens within the first 8 per
# token); typical text needs 3-5. Doubled until enough tokens come out; the whole text is the last resort.
_FIRST_SPAN_CHARS_PER_TOKEN = 16
_NON_SPACE = re.compile(r"\S")


@dataclass(frozen=True, slots=True)
class _Tokens:
    """Token ids and character offsets [(start, end)] of a rendered text: all of them (`limit` None), or only its
    first ones, exactly as the whole text's; `limit` is then where the last of them ends."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    ends: list[int]
    limit: int | None


class _NeedMore(Exception):
    """A bounded render could not decide a reply's end within the exact tokens: tokenise further."""


class RejectRow(Exception):
    """This conversation cannot be rendered into a training sample; `reason` is one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RenderedSample:
    """Token ids of the rendered conversation and, per token, whether it is a supervised assistant token."""

    input_ids: list[int]
    loss_mask: list[bool]

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


class ChatRenderer:
    """Turns `Message` lists into `RenderedSample`s with the tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face fast tokenizer with a chat template (offset mappings are needed).
        assistant_turns: "all" supervises every assistant reply, "last" only the final one.
        leading_assistant: assistant turns before the first user turn are kept as unsupervised
            context ("context") or removed ("drop").
        template_kwargs: extra template variables (`{"enable_thinking": False}`), as vLLM's
            `chat_template_kwargs`; given to every rendering.
        now: what the template's `strftime_now` reports (the date templates write into the system turn); the
            time the renderer is made when None.

    Raises:
        BadInput: no chat template, no character offsets, or a `template_kwargs` name the template never reads.
    """

    def __init__(
        self,
        tokenizer: Any,
        assistant_turns: Literal["all", "last"] = "all",
        leading_assistant: Literal["context", "drop"] = "context",
        template_kwargs: Mapping[str, Any] | None = None,
        now: datetime | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise BadInput(
                f"tokenizer {name} has no chat template; use a chat/instruct model or add chat_template.jinja"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise BadInput(
                f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer (tokenizer.json is needed)"
            )
        if assistant_turns not in ("all", "last") or leading_assistant not in ("context", "drop"):
            raise BadInput(
                f"bad renderer options: assistant_turns={assistant_turns!r}, leading_assistant={leading_assistant!r}"
            )
        self.tokenizer = tokenizer
        self.assistant_turns = assistant_turns
        self.leading_assistant = leading_assistant
        check_template_kwargs(tokenizer, template_kwargs or {})
        self.template_kwargs = dict(template_kwargs or {})
        self.now = now or datetime.now()
        special = set(tokenizer.all_special_ids)
        special.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
        self._special_ids = frozenset(special)
        texts = {tok.content for i, tok in tokenizer.added_tokens_decoder.items() if i in special}
        self._special_texts = sorted(texts | set(tokenizer.all_special_tokens), key=len, reverse=True)

    def render(self, messages: Sequence[Message], max_tokens: int | None = None) -> RenderedSample:
        """Render one conversation.

        Args:
            max_tokens: only the first `max_tokens` tokens are wanted (the caller truncates to its max length).
                A conversation whose rendered text is far longer than they can span is then tokenised only as far
                as needed (see `_tokenize`), so memory and time are bounded by `max_tokens`, not by the row.
                The result equals the whole rendering's first `max_tokens` ids and mask values (more when the
                text is short enough to be tokenised whole, as without `max_tokens`), and the same rows reject.

        Returns:
            RenderedSample with `input_ids` [T] and `loss_mask` [T] (True on assistant reply tokens).

        Raises:
            RejectRow: the template refuses the conversation, an assistant reply cannot be located in the
                rendered text, or nothing is left to supervise.
        """
        msgs = self._arrange(messages)
        supervised = self._supervised_turns(msgs)
        if not supervised:
            raise RejectRow("no assistant turn after the first user turn")
        supervised = [
            t for t in supervised if _says_something(msgs[t])
        ]  # a blank reply stays unsupervised context
        if not supervised:
            raise RejectRow(EMPTY_REPLY)
        full = self._render(msgs, generation_prompt=False)
        span = None if max_tokens is None else _FIRST_SPAN_CHARS_PER_TOKEN * max_tokens
        while True:
            toks = self._tokenize(full, span, max_tokens)
            if toks is None:  # the exact region holds fewer than max_tokens tokens: look further
                span *= 2  # type: ignore[operator]
                continue
            try:
                return self._masked(msgs, supervised, full, toks, max_tokens)
            except _NeedMore:
                span *= 2  # type: ignore[operator]

    def _masked(
        self,
        msgs: list[dict[str, Any]],
        supervised: list[int],
        full: str,
        toks: _Tokens,
        max_tokens: int | None,
    ) -> RenderedSample:
        """The loss mask over `toks` (the whole text's tokens, or its exact first ones)."""
        ids, offsets, ends = toks.ids, toks.offsets, toks.ends
        mask = [False] * len(ids)
        cursor = 0
        later = False  # (bounded) some reply lies past the exact region: its tokens would be supervised
        for turn in supervised:
            start, end = self._locate_reply(msgs, turn, full, cursor, toks)
            j = bisect.bisect_right(ends, start)  # first token ending after `start`
            while j < len(ids) and offsets[j][0] < end:
                mask[j] = offsets[j][1] > offsets[j][0]  # zero-width tokens carry no text
                j += 1
            later = later or (toks.limit is not None and end > max(start, toks.limit))
            cursor = end
        if not any(mask) and not later:
            raise RejectRow("no supervised tokens after rendering")
        if toks.limit is not None:
            return RenderedSample(ids[:max_tokens], mask[:max_tokens])
        return RenderedSample(ids, mask)

    def check_tokens(self, input_ids: Sequence[int], loss_mask: Sequence[bool]) -> RenderedSample:
        """A row that arrives already tokenised (on-policy data from `generate`), checked against this tokenizer.

        Its replies are its runs of consecutive supervised tokens (a `generate` row supervises each generated reply,
        stop token included, and the template text between replies is not): with assistant_turns "last" only the
        last run stays supervised. Example: mask [0,1,1,0,0,1,1,1] -> [0,0,0,0,0,1,1,1].

        Raises:
            RejectRow: an id outside the tokenizer, or nothing supervised.
        """
        top = max(input_ids, default=-1)
        if top >= len(self.tokenizer):
            raise RejectRow(f"token id {top} is outside the tokenizer ({len(self.tokenizer)} ids)")
        mask = [bool(m) for m in loss_mask]
        if not any(mask):
            raise RejectRow("no supervised tokens")
        if self.assistant_turns == "last":
            end = len(mask) - mask[::-1].index(True)  # one past the last supervised token
            start = end - 1
            while start > 0 and mask[start - 1]:
                start -= 1
            mask = [start <= i < end for i in range(len(mask))]
        return RenderedSample(list(input_ids), mask)

    def _tokenize(self, full: str, span: int | None, max_tokens: int | None) -> _Tokens | None:
        """Tokens of `full`; with `span`, of its first `span` characters only, when `full` is longer.

        Then only the tokens ending within the first half (`limit` = span // 2) are kept: a tokeniser may merge
        across the cut, but not back over span // 2 >= 8 * max_tokens characters (that would take one
        pre-tokenizer word, or BPE merge chain, that long). As a check, the same tokens must come out of twice
        the prefix. None when fewer than `max_tokens` tokens end within the limit (the caller doubles `span`).
        """
        if span is None or span >= len(full):
            enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
            offsets = [tuple(o) for o in enc["offset_mapping"]]
            return _Tokens(list(enc["input_ids"]), offsets, [e for _, e in offsets], None)
        limit = span // 2
        kept = []
        for cut in (span, 2 * span):
            enc = self.tokenizer(full[:cut], add_special_tokens=False, return_offsets_mapping=True)
            offsets = [tuple(o) for o in enc["offset_mapping"]]
            n = bisect.bisect_right([e for _, e in offsets], limit)
            kept.append((list(enc["input_ids"][:n]), offsets[:n]))
            if n < (max_tokens or 0):
                return None
            if cut >= len(full):
                break
        if len(kept) == 2 and kept[0] != kept[1]:  # a merge reached back over the limit: look further
            return None
        ids, offsets = kept[0]
        ends = [e for _, e in offsets]
        return _Tokens(ids, offsets, ends, ends[-1] if ends else 0)

    def render_text(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        """The chat template's text for template-ready `{role, content}` dicts (no tokenisation).

        Raises:
            RejectRow: the template refuses the conversation.
        """
        return self._render(messages, generation_prompt)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special tokens (incl. added special tokens)."""
        return self._special_ids

    # ------------------------------------------------------------------------------------------- helpers

    def _arrange(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        """Messages as template dicts (OpenAI tool fields passed through); leading assistant turns dropped if asked."""
        msgs = [_template_dict(m) for m in messages]
        if self.leading_assistant == "drop":
            first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
            msgs = [m for i, m in enumerate(msgs) if i >= first_user or m["role"] != "assistant"]
        if not msgs:
            raise RejectRow("empty conversation")
        return msgs

    def _supervised_turns(self, msgs: list[dict[str, Any]]) -> list[int]:
        """Indices of assistant turns that come after a user turn (earlier ones are context)."""
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if first_user is None:
            return []
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > first_user]
        return turns[-1:] if self.assistant_turns == "last" else turns

    def _render(self, msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                strftime_now=self.now.strftime,
                **self.template_kwargs,
            )
        except Exception as err:  # jinja2 TemplateError / raise_exception() in the template
            raise RejectRow(
                f"chat template refused the conversation: {str(err).splitlines()[0][:160]}"
            ) from None
        if not isinstance(text, str):
            raise RejectRow("chat template did not render to text")
        return text

    def _prefix_len(self, msgs: list[dict[str, Any]], full: str, generation_prompt: bool) -> int | None:
        """Length of the rendering of `msgs` if it is a prefix of `full`, else None."""
        try:
            text = self._render(msgs, generation_prompt)
        except RejectRow:
            return None
        return len(text) if full.startswith(text) else None

    def _locate_reply(
        self,
        msgs: list[dict[str, Any]],
        turn: int,
        full: str,
        cursor: int,
        toks: _Tokens,
    ) -> tuple[int, int]:
        """Character span [start, end) of assistant turn `turn`'s reply in `full`: content + end-of-turn token(s).

        Example (ChatML): full = "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n".
        The prefix with the generation prompt ends right after "assistant\\n", so start points at "Hello";
        the end-of-turn scan stops after "<|im_end|>", leaving the trailing "\\n" unsupervised.
        """
        content = msgs[turn]["content"].strip()  # templates may trim
        start = self._prefix_len(msgs[:turn], full, generation_prompt=True)
        search_from = start if start is not None and start >= cursor else cursor
        if start is None or start < cursor:
            base = self._prefix_len(msgs[:turn], full, generation_prompt=False)
            search_from = max(cursor, base or 0)
        reasoning = (msgs[turn].get("reasoning_content") or "").strip()
        r0 = full.find(reasoning, search_from) if reasoning else -1
        if r0 >= 0:  # rendered before the content (a <think> block, an analysis channel), which it may quote
            search_from = r0 + len(reasoning)
        c0 = full.find(content, search_from) if content else search_from
        if c0 < 0:
            raise RejectRow(f"assistant turn {turn}: its content was not found in the rendered chat template")
        if start is None or start < cursor or start > c0:
            start = c0  # header unknown: supervise from the content itself
        c1 = c0 + len(content)
        after = self._prefix_len(msgs[: turn + 1], full, generation_prompt=False)
        if msgs[turn].get("tool_calls"):
            bound = (
                len(full) if after is not None and after >= c1 else self._next_message_end(msgs, turn, full)
            )
            return start, self._end_of_tool_calls(msgs[turn], turn, full, c1, after, bound, toks)
        bound = after if after is not None and after >= c1 else len(full)
        return start, self._end_of_turn(full, c1, bound, toks)

    def _end_of_turn_in_text(self, full: str, c1: int, bound: int) -> int:
        """`_end_of_turn` without tokens: special tokens are split out of the text before anything else, so the
        first non-whitespace after the content is a special token exactly when its text starts there."""
        m = _NON_SPACE.search(full, c1, bound)
        if m is not None:
            for text in self._special_texts:
                if full.startswith(text, m.start()):
                    return m.start() + len(text)
        return c1

    def _end_of_tool_calls(
        self,
        msg: dict[str, Any],
        turn: int,
        full: str,
        c1: int,
        after: int | None,
        bound: int,
        toks: _Tokens,
    ) -> int:
        """End of an assistant turn with tool calls: the calls as the template renders them (whatever their
        syntax) and the end-of-turn token(s), i.e. the turn's rendering up to its last non-whitespace token.

        Raises:
            RejectRow: the turn's end cannot be found, or the template renders no tool calls (it would
                supervise an empty reply): such conversations are rejected with that reason, never dropped silently.
        """
        names = [call["function"]["name"] for call in msg["tool_calls"]]
        if (
            after is None or after < c1
        ):  # the template renders the newest turn otherwise (Qwen3: a <think> block)
            return self._end_of_tool_calls_in_text(names, turn, full, c1, bound, toks)
        if not all(name in full[c1:after] for name in names):
            raise RejectRow(f"the chat template does not render tool calls (turn {turn})")
        if toks.limit is not None and after > toks.limit:  # the turn ends past the exact tokens
            if c1 >= toks.limit or _NON_SPACE.search(full, toks.limit, after):
                return after  # so does its last non-whitespace token: the exact tokens' mask is the same
            raise _NeedMore
        end = c1
        for s, e in toks.offsets[bisect.bisect_right(toks.ends, c1) :]:
            if e > after:
                break
            if e > s and not full[s:e].isspace():
                end = e
        return end

    def _end_of_tool_calls_in_text(
        self, names: list[str], turn: int, full: str, c1: int, bound: int, toks: _Tokens
    ) -> int:
        """End of a tool-call turn whose rendering as the newest turn is not a prefix of the whole conversation
        (Qwen3 writes an empty `<think>` block there): the whole rendering is what the server sees, and in it the
        turn is the calls, in order, then the template's end-of-turn: the first special token after the last
        call's name, before the end of the next message (`bound`).

        Raises:
            RejectRow: a call's name is not rendered, or no special token closes the turn before `bound`.
        """
        pos = c1
        for name in names:
            at = full.find(name, pos, bound)
            if at < 0:
                raise RejectRow(f"the chat template does not render tool calls (turn {turn})")
            pos = at + len(name)
        if toks.limit is not None and pos >= toks.limit:  # past the exact tokens: decide from the text
            hits = [k for k in (full.find(t, pos, bound) for t in self._special_texts) if k >= 0]
            if hits:
                k = min(hits)
                return k + len(next(t for t in self._special_texts if full.startswith(t, k)))
        else:
            for j in range(bisect.bisect_right(toks.ends, pos), len(toks.ids)):
                s, e = toks.offsets[j]
                if s >= bound:
                    break
                if e > s and toks.ids[j] in self._special_ids:
                    return e
            else:
                if toks.limit is not None:  # ran out of the exact tokens before the turn's end
                    raise _NeedMore
        raise RejectRow(
            f"assistant turn {turn}: its tool calls cannot be located in the rendered chat template"
        )

    def _next_message_end(self, msgs: list[dict[str, Any]], turn: int, full: str) -> int:
        """Where the message after `turn` ends in `full` (its rendering through it, when that is a prefix: it is
        with Qwen3, whose tool results follow the call), else the text's end: no reply runs past it."""
        if turn + 1 >= len(msgs):
            return len(full)
        end = self._prefix_len(msgs[: turn + 2], full, generation_prompt=False)
        return end if end is not None else len(full)

    def _end_of_turn(self, full: str, c1: int, bound: int, toks: _Tokens) -> int:
        """End of the reply: through the first special token after the content (only whitespace between)."""
        ids, offsets = toks.ids, toks.offsets
        first = bisect.bisect_right(toks.ends, c1)
        if toks.limit is not None and c1 >= toks.limit:  # past the exact tokens: decide from the text
            return self._end_of_turn_in_text(full, c1, bound)
        for j in range(first, len(ids)):
            tid, (s, e) = ids[j], offsets[j]
            if e <= s:
                continue
            if s >= bound:
                break
            if tid in self._special_ids:
                return e
            if not full[max(s, c1) : e].isspace():
                break
        else:  # ran out of tokens: undecided if they are only the exact first ones and the reply is among them
            if toks.limit is not None and c1 < toks.limit:
                raise _NeedMore
        return c1


_PROBE = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "v"},
]


def template_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids the chat template itself writes (role headers, end-of-turn and generation-prompt tokens).

    Found by rendering a small probe conversation with and without the generation prompt (and without the
    system turn, for templates that refuse one) and tokenising it; the probe's own one-letter contents add
    a few ordinary ids, which is harmless for the mask-token rule that uses this. Empty without a template.
    """
    if not getattr(tokenizer, "chat_template", None):
        return frozenset()
    ids: set[int] = set()
    for msgs in (_PROBE, _PROBE[1:], _PROBE[1:2]):
        for prompt in (False, True):
            try:
                text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
            except Exception:  # a template may refuse a system turn or a trailing user turn
                continue
            if isinstance(text, str):
                ids.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return frozenset(ids)


def _says_something(msg: dict[str, Any]) -> bool:
    """An assistant turn with text other than whitespace, or with tool calls (see `EMPTY_REPLY`)."""
    return bool(msg.get("tool_calls")) or bool(msg["content"].strip())


def _template_dict(m: Message) -> dict[str, Any]:
    """A message as chat templates take it; tool and reasoning fields only when present, so plain chats render as
    before. Reasoning goes under the names templates read it by: `reasoning_content` (Qwen3, DeepSeek-R1) and
    `thinking` (gpt-oss); a template that reads neither leaves it out, as it would when serving."""
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning:
        d["reasoning_content"] = d["thinking"] = m.reasoning
    return d
