"""Every `peagle-pipeline ...` command line shown in the docs parses with the real CLI.

Command lines are taken from fenced code blocks and inline code spans of README.md and docs/**/*.md. Placeholders
(RUN, CACHE, ...) are ordinary arguments; optional parts in brackets, `...` elisions and trailing comments are
dropped before parsing, so a line that omits a required option (`export RUN OUT`) fails.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import typer

from peagle_pipeline.cli import app

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _code_lines(text: str) -> list[str]:
    """Lines of fenced code blocks (continuations joined) and inline code spans."""
    lines: list[str] = []
    fenced = False
    pending = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            lines.append(line)
        else:
            lines += re.findall(r"`([^`]+)`", raw)
    return lines


def _documented_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for line in _code_lines(doc.read_text(encoding="utf-8")):
            line = line.split("#")[0].strip().removeprefix("$ ")
            if not line.startswith("peagle-pipeline ") or "..." in line or "…" in line:
                continue
            line = re.sub(r"\[[^\]]*\]", " ", line)  # optional parts
            args = [a for a in shlex.split(line)[1:] if a != "flags"]  # `extract [--config FILE] [flags]`
            if len(args) >= 2 and not args[0].startswith("-") and "--help" not in args:
                # not a command merely named in prose, nor a help request
                found.append((str(doc.relative_to(REPO)), line))
    return found


COMMANDS = _documented_commands()


def test_the_docs_show_command_lines() -> None:
    assert any(line.startswith("peagle-pipeline export ") for _, line in COMMANDS)


@pytest.mark.parametrize(("doc", "line"), COMMANDS)
def test_documented_command_line_parses(doc: str, line: str) -> None:
    group = typer.main.get_command(app)
    args = [a for a in shlex.split(line)[1:] if a != "flags"]
    command = group.get_command(click.Context(group), args[0])
    assert command is not None, f"{doc}: unknown command in {line!r}"
    try:
        command.make_context(args[0], args[1:], resilient_parsing=False)
    except click.ClickException as err:
        pytest.fail(f"{doc}: {line!r} does not parse: {err.format_message()}")
