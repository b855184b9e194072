"""Render a conversation with the target tokenizer's own chat template into token ids and an assistant loss mask.

The mask is derived without `{% generation %}` tags: each assistant reply is located by rendering the
conversation prefix that ends with the generation prompt, so the reply is exactly what the model would generate
after that prompt: the content and the end-of-turn token(s) that follow it (`<|im_end|>`, `<|eot_id|>`, ...),
never role headers, injected system prompts or the separator after the end-of-turn token.
Pure given a tokenizer: no file I/O, no model.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from peagle_pipeline.data.formats import Message
from peagle_pipeline.errors import BadInput

__all__ = ["ChatRenderer", "RenderedSample", "RejectRow"]


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

    Raises:
        BadInput: the tokenizer has no chat template or cannot report character offsets.
    """

    def __init__(
        self,
        tokenizer: Any,
        assistant_turns: Literal["all", "last"] = "all",
        leading_assistant: Literal["context", "drop"] = "context",
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
        special = set(tokenizer.all_special_ids)
        special.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
        self._special_ids = frozenset(special)

    def render(self, messages: Sequence[Message]) -> RenderedSample:
        """Render one conversation.

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
        full = self._render(msgs, generation_prompt=False)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = list(enc["input_ids"])
        offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
        ends = [e for _, e in offsets]
        mask = [False] * len(ids)
        cursor = 0
        for turn in supervised:
            start, end = self._locate_reply(msgs, turn, full, cursor, ids, offsets, ends)
            j = bisect.bisect_right(ends, start)  # first token ending after `start`
            while j < len(ids) and offsets[j][0] < end:
                mask[j] = offsets[j][1] > offsets[j][0]  # zero-width tokens carry no text
                j += 1
            cursor = end
        if not any(mask):
            raise RejectRow("no supervised tokens after rendering")
        return RenderedSample(ids, mask)

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

    def _arrange(self, messages: Sequence[Message]) -> list[dict[str, str]]:
        """Messages as template dicts; leading assistant turns dropped if asked."""
        msgs = [{"role": m.role, "content": m.content} for m in messages]
        if self.leading_assistant == "drop":
            first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
            msgs = [m for i, m in enumerate(msgs) if i >= first_user or m["role"] != "assistant"]
        if not msgs:
            raise RejectRow("empty conversation")
        return msgs

    def _supervised_turns(self, msgs: list[dict[str, str]]) -> list[int]:
        """Indices of assistant turns that come after a user turn (earlier ones are context)."""
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if first_user is None:
            return []
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > first_user]
        return turns[-1:] if self.assistant_turns == "last" else turns

    def _render(self, msgs: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as err:  # jinja2 TemplateError / raise_exception() in the template
            raise RejectRow(
                f"chat template refused the conversation: {str(err).splitlines()[0][:160]}"
            ) from None
        if not isinstance(text, str):
            raise RejectRow("chat template did not render to text")
        return text

    def _prefix_len(self, msgs: list[dict[str, str]], full: str, generation_prompt: bool) -> int | None:
        """Length of the rendering of `msgs` if it is a prefix of `full`, else None."""
        try:
            text = self._render(msgs, generation_prompt)
        except RejectRow:
            return None
        return len(text) if full.startswith(text) else None

    def _locate_reply(
        self,
        msgs: list[dict[str, str]],
        turn: int,
        full: str,
        cursor: int,
        ids: list[int],
        offsets: list[tuple[int, int]],
        ends: list[int],
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
        c0 = full.find(content, search_from) if content else search_from
        if c0 < 0:
            raise RejectRow(f"assistant turn {turn}: its content was not found in the rendered chat template")
        if start is None or start < cursor or start > c0:
            start = c0  # header unknown: supervise from the content itself
        c1 = c0 + len(content)
        after = self._prefix_len(msgs[: turn + 1], full, generation_prompt=False)
        bound = after if after is not None and after >= c1 else len(full)
        return start, self._end_of_turn(full, c1, bound, ids, offsets, ends)

    def _end_of_turn(
        self, full: str, c1: int, bound: int, ids: list[int], offsets: list[tuple[int, int]], ends: list[int]
    ) -> int:
        """End of the reply: through the first special token after the content (only whitespace between)."""
        for j in range(bisect.bisect_right(ends, c1), len(ids)):
            tid, (s, e) = ids[j], offsets[j]
            if e <= s:
                continue
            if s >= bound:
                break
            if tid in self._special_ids:
                return e
            if not full[max(s, c1) : e].isspace():
                break
        return c1
