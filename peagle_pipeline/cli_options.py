"""Command-line options built from the config dataclasses, so that a setting is declared once (in config/).

`config_command(app, Config)` turns a function of a resolved config into a typer command whose options are the
fields of `Config`: `--name` for field `name` (`--name/--no-name` for a bool), its help text with the default from
the field's metadata, the allowed values as metavar for a `Literal` field, and a positional argument for a field
marked `argument`. Every option defaults to None ("not given"), so the config's defaults, a pipeline file and the
flags combine in one place (`config.resolve`). Never imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from peagle_pipeline.config import SECTIONS, describe_fields, field_choices, is_required, resolve

__all__ = ["config_command", "field_help"]

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Pipeline file (YAML); flags override its section.", metavar="FILE"),
]


def _default_note(cls: type, name: str, default: Any) -> str:
    """ " [default: ...]" for the help line of field `name` ("" when there is nothing to show)."""
    if is_required(cls, name):  # typer itself marks a required flag of a command without a pipeline file
        return " [required: flag or pipeline file]" if cls in SECTIONS else ""
    if default in ("", [], {}, None):
        return ""
    if isinstance(default, bool):
        flag = name.replace("_", "-")
        return f" [default: --{flag if default else 'no-' + flag}]"
    if isinstance(default, list):
        return f" [default: {','.join(map(str, default))}]"
    return f" [default: {default}]"


def field_help(cls: type) -> dict[str, str]:
    """The help line of every field of `cls`: its description and its default."""
    return {name: help + _default_note(cls, name, default) for name, help, default in describe_fields(cls)}


def _flag_type(hint: Any, comma: bool) -> Any:
    """The type typer parses a field's flag as: lists stay lists (a repeatable option) unless the field is given as
    one comma-separated value; choices, mappings (JSON) and everything else are read as text or as the scalar."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list and not comma:
        return list[typing.get_args(hint)[0]]  # type: ignore[misc]
    return hint if hint in (bool, int, float) else str


def _parameter(cls: type, f: dataclasses.Field[Any], hint: Any, help_text: str) -> inspect.Parameter:
    """The typer parameter of field `f`: an option (or argument) that defaults to None, or a required one for a
    required field of a command that has no pipeline file."""
    choices = field_choices(cls, f.name)
    metavar = f.metadata.get("metavar") or ("[" + "|".join(map(str, choices)) + "]" if choices else None)
    kind = _flag_type(hint, bool(f.metadata.get("comma")))
    required = is_required(cls, f.name) and cls not in SECTIONS
    if f.metadata.get("argument"):
        info: Any = typer.Argument(help=help_text, metavar=metavar)
    else:
        flag = "--" + f.name.replace("_", "-")
        decls = [f"{flag}/--no-{flag[2:]}"] if kind is bool else [flag]
        info = typer.Option(*decls, help=help_text, metavar=metavar)
    annotation = Annotated[kind if required else kind | None, info]  # type: ignore[valid-type]
    default = inspect.Parameter.empty if required else None
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _parameters(cls: type) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    params = [_parameter(cls, f, hints[f.name], helps[f.name]) for f in dataclasses.fields(cls)]
    if cls in SECTIONS:
        config = inspect.Parameter(
            "config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ConfigOpt
        )
        params.insert(0, config)
    return params


def _mode(name: str, spec: str | tuple[type, str, str]) -> inspect.Parameter:
    """`--name`, an option of the command that is no setting (it changes what the command does or how it runs):
    a switch when `spec` is its help (`--plan`), else an option with a value, `spec` = (type, metavar, help),
    None when not given (`--nproc-per-node N`)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(spec, str):
        info = typer.Option(flag, help=spec)
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, info]
        )
    kind, metavar, help_text = spec
    info = typer.Option(flag, help=help_text, metavar=metavar)
    annotation = Annotated[kind | None, info]  # type: ignore[valid-type]
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def config_command(
    app: typer.Typer,
    cls: type,
    name: str | None = None,
    modes: dict[str, str | tuple[type, str, str]] | None = None,
) -> Callable[[Callable[..., Any]], Any]:
    """Register the decorated function as command `name` (default: the function's name, `_` as `-`) with one
    option per field of `cls`, and an option per entry of `modes` that is no setting (name -> help of a switch,
    or (type, metavar, help) of an option with a value); its docstring is the command's help. A function with a
    `ctx` parameter also gets typer's context (its `obj` is the command line `cli.main()` parsed).

    A command with a pipeline-file section (generate, extract, train) is called with the resolved config
    (defaults < pipeline file < flags) and its switches as keywords; a flag-only command (evaluate, vllm-check)
    with the flags given, as keyword arguments, for the stage to build its config (so that a stage can check its
    runtime first).
    """
    switches = dict(modes or {})

    def register(fn: Callable[..., Any]) -> Any:
        wants_ctx = "ctx" in inspect.signature(fn).parameters

        @functools.wraps(fn)
        def command(**given: Any) -> Any:
            config = given.pop("config", None)
            chosen = {k: given.pop(k) for k in switches}
            if wants_ctx:
                chosen["ctx"] = given.pop("ctx")
            flags = {k: v for k, v in given.items() if v is not None}
            if cls in SECTIONS:
                return fn(resolve(cls, config, flags), **chosen)
            return fn(
                **{k: v for k, v in flags.items() if v != []}, **chosen
            )  # an unrepeated list: not given

        params = _parameters(cls) + [_mode(k, spec) for k, spec in switches.items()]
        if wants_ctx:
            params.append(inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))
        del command.__wrapped__  # typer reads the signature below, not the wrapped function's
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        app.command(name or fn.__name__.replace("_", "-"))(command)
        return command

    return register
