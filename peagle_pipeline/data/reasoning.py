"""A generated reply split into its reasoning and its answer, in the two ways targets write reasoning.

Think tags (Qwen3, DeepSeek-R1 and their distills): the reply is "<think>\\nwhy\\n</think>\\n\\nHello"; its
thinking is "\\nwhy\\n", its answer "Hello", and a template writes it as an earlier turn as "Hello" (Qwen3's strips
the thinking itself).

Harmony (gpt-oss): after the generation prompt "<|start|>assistant" the model writes messages on channels,
"<|channel|>analysis<|message|>why<|end|><|start|>assistant<|channel|>final<|message|>Hello"; its thinking is the
analysis text "why", its answer the final channel's "Hello", and the template writes it as an earlier turn as
"<|channel|>final<|message|>Hello" (then "<|end|>", where the newest reply ends with "<|return|>"). The template
refuses channel tags in a message's content: the answer goes in `content`, the thinking in `thinking`.

Pure string work: no tokenizer calls beyond reading which special tokens exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Reply", "reply_parts", "uses_harmony", "THINK_END"]

THINK_END = "</think>"  # ends the reasoning part of a reply (Qwen3, DeepSeek-R1 and their distills)
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")
_ANALYSIS = "<|channel|>analysis<|message|>"
_FINAL = "<|channel|>final<|message|>"
_MESSAGE_END = "<|end|>"


@dataclass(frozen=True, slots=True)
class Reply:
    """One generated reply's text in its parts.

    thinking: the reasoning ("" when the reply has none).
    answer: what a client sends back as the message's `content`.
    written: the suffix of the reply's text that the template writes for it as an earlier turn, before its
        end-of-turn text (the answer for think tags; the final channel's header and answer for harmony).
    """

    thinking: str
    answer: str
    written: str

    def message(self, keep_thinking: bool, harmony: bool, text: str) -> dict[str, str]:
        """The assistant message given to the template for later turns (`text`: the whole reply)."""
        if not keep_thinking:
            return {"role": "assistant", "content": self.answer}
        if harmony:  # the template takes reasoning in its own field only
            extra = {"thinking": self.thinking} if self.thinking else {}
            return {"role": "assistant", "content": self.answer, **extra}
        return {"role": "assistant", "content": text}


def uses_harmony(tokenizer: Any) -> bool:
    """The tokenizer has harmony's message tokens as special tokens (gpt-oss)."""
    specials = {tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special}
    return all(t in specials for t in HARMONY_TOKENS)


def reply_parts(text: str, harmony: bool) -> Reply | None:
    """`text` (a reply as its ids decode, special tokens written) in its parts.

    Examples:
        >>> reply_parts("<think>\\nwhy\\n</think>\\n\\nHello", harmony=False)
        Reply(thinking='\\nwhy\\n', answer='Hello', written='Hello')
        >>> r = reply_parts("<|channel|>analysis<|message|>why<|end|><|start|>assistant"
        ...                 "<|channel|>final<|message|>Hello", harmony=True)
        >>> r.thinking, r.answer, r.written
        ('why', 'Hello', '<|channel|>final<|message|>Hello')

    None for a harmony reply that has channels but no final one (a tool call, or reasoning cut short): it has
    no answer to give back. A reply with no harmony tags at all is its own answer (the template then writes a
    channel header the model did not generate).
    """
    if harmony:
        at = text.rfind(_FINAL)
        if at < 0:
            return None if "<|channel|>" in text else Reply("", text, text)
        # each analysis message's text, up to its <|end|>
        analysis = [part.split(_MESSAGE_END)[0] for part in text[:at].split(_ANALYSIS)[1:]]
        answer = text[at + len(_FINAL) :]
        return Reply("\n\n".join(analysis), answer, text[at:])
    if THINK_END not in text:
        return Reply("", text, text)
    head, _, tail = text.rpartition(THINK_END)
    answer = tail.lstrip("\n")
    return Reply(head.removeprefix("<think>"), answer, answer)
