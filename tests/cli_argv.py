"""argv helpers for tests that run the real CLI as a subprocess (Popen, kill -9, torchrun)."""

from __future__ import annotations

import sys

PEAGLE = [sys.executable, "-m", "peagle_pipeline.cli"]
"""`peagle-pipeline` run with this interpreter: PEAGLE + ["train", ...]."""


def flags(**options: object) -> list[str]:
    """CLI flags from keyword options, in order: depths=3 -> ["--depths", "3"]; True -> "--name",
    False -> "--no-name"; underscores become dashes."""
    argv: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv
