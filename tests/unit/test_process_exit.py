"""A command's process exits without the final garbage collection (peagle_pipeline/process_exit.py)."""

from __future__ import annotations

import subprocess
import sys

# An exit handler registered before the command runs after the command's own (last registered, first run): it sees
# the heap as the interpreter's teardown will.
PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))
if sys.argv[1] == "command":
    from peagle_pipeline.cli import main
    main(["--version"])
"""


def _frozen_at_exit(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("frozen at exit:")]
    assert len(line) == 1, out.stdout
    return int(line[0].split(":")[1])


def test_a_command_leaves_its_heap_frozen_for_the_interpreters_exit() -> None:
    assert _frozen_at_exit("plain") == 0  # the probe itself freezes nothing
    assert _frozen_at_exit("command") > 1000  # every object the CLI imported


def test_registering_twice_adds_one_handler() -> None:
    probe = (
        "import atexit\n"
        "calls = []\n"
        "atexit.register = lambda fn: calls.append(fn)\n"
        "from peagle_pipeline.process_exit import skip_final_collection\n"
        "skip_final_collection(); skip_final_collection()\n"
        "print(len(calls))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-2000:]
