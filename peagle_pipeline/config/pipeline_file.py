"""Pipeline files and overrides: reading a section of a pipeline file (YAML) and building a config from defaults <
pipeline-file section < flags, with unknown keys refused (naming the closest valid one) and values coerced to the
field types."""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from peagle_pipeline.config.checks import template_kwargs
from peagle_pipeline.config.extract import ExtractConfig
from peagle_pipeline.config.generate import GenerateConfig
from peagle_pipeline.config.train import TrainConfig
from peagle_pipeline.errors import BadConfig

__all__ = ["SECTIONS", "load_section", "resolve", "to_dict"]


C = TypeVar("C", GenerateConfig, ExtractConfig, TrainConfig)
SECTIONS: dict[type, str] = {GenerateConfig: "generate", ExtractConfig: "extract", TrainConfig: "train"}


def load_section(yaml_path: str | Path, section: str) -> dict[str, Any]:
    """Read one section (`generate`, `extract` or `train`) of a pipeline file; a missing section is empty."""
    import yaml

    path = Path(yaml_path)
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_unique_keys_loader()) or {}
    except _DuplicateKey as err:
        raise BadConfig(f"pipeline file {path}: {err}") from None
    except FileNotFoundError:
        raise BadConfig(f"pipeline file not found: {path}") from None
    except IsADirectoryError:
        raise BadConfig(f"pipeline file {path} is a directory: give the YAML file itself (-c FILE)") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise BadConfig(f"pipeline file {path} is not valid YAML{where}") from None
    if not isinstance(doc, dict):
        raise BadConfig(
            f"pipeline file {path} must be a mapping with 'generate:', 'extract:' and/or 'train:' sections"
        )
    unknown = set(doc) - set(SECTIONS.values())
    if unknown:
        raise BadConfig(
            f"pipeline file {path}: unknown section(s) {sorted(unknown)}; expected 'generate', 'extract' and 'train'"
        )
    body = doc.get(section) or {}
    if not isinstance(body, dict):
        raise BadConfig(f"pipeline file {path}: section '{section}' must be a mapping")
    return body


class _DuplicateKey(Exception):
    """A mapping of a pipeline file names one key twice (YAML would silently keep the last value)."""


def _unique_keys_loader() -> Any:
    """yaml's SafeLoader, refusing a key given twice in one mapping (line numbers from 1)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, collections.abc.Hashable):  # refused by the mapping itself below
                    continue
                if key in seen:
                    raise _DuplicateKey(
                        f"key {key!r} is given twice (lines {seen[key]} and {line}); keep one"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeys


def resolve(cls: type[C], yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> C:
    """Build a config: defaults < pipeline-file section < overrides (flags given, i.e. not None).

    Raises:
        BadConfig: unknown key (with the closest valid name), wrong type, or invalid value.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    if yaml_path is not None:
        section = SECTIONS[cls]
        for key, value in load_section(yaml_path, section).items():
            values[_check_key(str(key).replace("-", "_"), names, f"section '{section}' of {yaml_path}")] = (
                value
            )
    for key, value in (overrides or {}).items():
        if value is not None:
            values[_check_key(key, names, "flags")] = value
    hints = typing.get_type_hints(cls)
    coerced = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    return cls(**coerced)


def _check_key(key: str, names: list[str], where: str) -> str:
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise BadConfig(f"unknown setting {key!r} in {where}{hint}")
    return key


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Accept YAML/flag values for a field type: comma strings for int lists, scalars for str lists."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if origin is list:
        item = args[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if item is int else [value]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(name, v, item) for v in value]
    if origin is dict:  # the one mapping setting: chat_template_kwargs
        return template_kwargs(value, name)
    if origin is Literal:
        if value not in args:
            raise BadConfig(f"{name} must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    try:
        if hint is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise TypeError
            return value
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if hint is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise TypeError
            return str(value)
    except (TypeError, ValueError):
        raise BadConfig(f"{name} must be of type {getattr(hint, '__name__', hint)}; got {value!r}") from None
    return value


def to_dict(cfg: GenerateConfig | ExtractConfig | TrainConfig) -> dict[str, Any]:
    """The resolved config as a plain dict (written beside outputs, compared on resume)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
