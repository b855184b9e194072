"""How a setting is declared: a dataclass field whose metadata holds its one-line help (the CLI help and
docs/reference/pipeline-files.md are generated from it), `required`, and for the CLI `argument` / `metavar` / `comma` (a list given as one comma-separated value); and the fields
and help texts several commands share."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import field
from typing import Any

from peagle_pipeline.core.settings import GPU_MEMORY_UTILIZATION, TENSOR_PARALLEL_SIZE, CODConfig

__all__ = [
    "COD_DEFAULTS",
    "ALLOW_OTHER_TARGET_HELP",
    "setting",
    "tensor_parallel_setting",
    "gpu_memory_setting",
    "reword",
    "template_kwargs_setting",
]


# The COD defaults are CODConfig's (defined once, in core/settings.py).
COD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CODConfig)}


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A field with `default` (a list or dict default is copied per instance), its `help` and other metadata `kw`."""
    if isinstance(default, (list, dict)):
        copy = functools.partial(type(default), default)
        return field(default_factory=copy, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def tensor_parallel_setting() -> Any:
    """`tensor_parallel_size` of every command that starts a vLLM engine (its value: core/settings.py)."""
    return setting(TENSOR_PARALLEL_SIZE, "vLLM tensor parallel size.")


def gpu_memory_setting() -> Any:
    """`gpu_memory_utilization` of every command that starts a vLLM engine (its value: core/settings.py);
    checked by `check_gpu_memory`."""
    return setting(GPU_MEMORY_UTILIZATION, "vLLM GPU memory fraction.")


def template_kwargs_setting() -> Any:
    """`chat_template_kwargs` of every command that renders chats with the target's template (checked by
    `checks.template_kwargs`)."""
    return setting(
        {},
        "Extra chat-template variables, as vLLM's chat_template_kwargs: a JSON object on the command line "
        '(\'{"enable_thinking": false}\' for Qwen3 without reasoning, \'{"reasoning_effort": "low"}\' for '
        "gpt-oss), a mapping in a pipeline file. Use what the served requests will use; a name the template never "
        "reads is refused.",
        metavar="JSON",
    )


def reword(base: type, name: str, help: str) -> Any:
    """Field `name` of `base` with this command's own help text (same default, same metadata otherwise)."""
    f = {f.name: f for f in dataclasses.fields(base)}[name]
    kw = {k: v for k, v in f.metadata.items() if k != "help"}
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata={**kw, "help": help})
    return field(default=f.default, metadata={**kw, "help": help})


ALLOW_OTHER_TARGET_HELP = (
    "Run a draft on a target whose config.json or tokenizer differ from the one it was trained on (a warning "
    "instead of a refusal)."
)
