"""The variables a chat template reads, and the check that every `chat_template_kwargs` name is one of them.

A misspelt variable (`enable_thinkng`) or one the template never reads (`enable_thinking` on a template without a
thinking mode) renders exactly as if none were given: the rows, the cache or the measured prompts silently lack
what the user asked for. The template's undeclared variables (jinja2's `meta.find_undeclared_variables` on its
source) are the names it can read; a given name outside them is refused, listing the ones it does read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from peagle_pipeline.errors import BadInput

__all__ = ["template_variables", "check_template_kwargs"]

# what the rendering itself gives every template (transformers' apply_chat_template, and `strftime_now`)
_GIVEN_BY_RENDERING = frozenset(
    "messages tools documents add_generation_prompt continue_final_message strftime_now raise_exception".split()
)


def template_variables(tokenizer: Any) -> frozenset[str] | None:
    """The names `tokenizer`'s chat template reads that a caller may set: its undeclared variables, less what the
    rendering passes itself (the messages, tools, special tokens, ...). None when the template cannot be parsed here
    (its rendering reports that)."""
    import jinja2
    from jinja2 import meta

    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template]
    found: set[str] = set()
    for source in sources:
        if not isinstance(source, str):
            continue
        try:
            env = _environment(source)
            found |= meta.find_undeclared_variables(env.parse(source))
        except (jinja2.TemplateError, ImportError, TypeError, ValueError):
            return None
        found -= set(env.globals)
    specials = set(getattr(tokenizer, "special_tokens_map", None) or {})
    return frozenset(found - _GIVEN_BY_RENDERING - specials)


def _environment(source: str) -> Any:
    """The jinja2 environment transformers renders chat templates in (its `{% generation %}` tag included)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(source).environment


def check_template_kwargs(
    tokenizer: Any, kwargs: Mapping[str, Any], name: str = "chat_template_kwargs"
) -> None:
    """Refuse template variables in `kwargs` that `tokenizer`'s chat template never reads.

    Raises:
        BadInput: one line naming the unread variables and listing the ones the template reads.
    """
    if not kwargs:
        return
    reads = template_variables(tokenizer)
    if reads is None:
        return
    unread = sorted(k for k in kwargs if k not in reads)
    if not unread:
        return
    model = getattr(tokenizer, "name_or_path", "") or "the target"
    listed = f"it reads: {', '.join(sorted(reads))}" if reads else "it reads no variable of its own"
    raise BadInput(
        f"{name}: {', '.join(unread)} {'is' if len(unread) == 1 else 'are'} never read by the chat template of "
        f"{model} ({listed}); a variable the template does not read changes nothing"
    )
