"""What a config class says about its fields: help and defaults, required fields, the choices of a `Literal` field
(the source of the CLI help and of docs/reference/pipeline-files.md)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

__all__ = ["describe_fields", "is_required", "field_choices"]


def field_choices(cls: type, name: str) -> tuple[Any, ...]:
    """The allowed values of a `Literal[...]` field (also inside `X | None`); () for any other type."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def is_required(cls: type, name: str) -> bool:
    """True for a field the user must give (flag or pipeline file); its check is `require` in `__post_init__`."""
    return bool({f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("required", False))


def describe_fields(cls: type) -> list[tuple[str, str, Any]]:
    """(name, help, default) of every field: the source of the CLI help and the pipeline-file docs."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        out.append((f.name, f.metadata.get("help", ""), default))
    return out
