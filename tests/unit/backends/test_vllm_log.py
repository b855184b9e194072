"""backends/vllm_log.py in a subprocess of its own (it changes process-wide logging and file descriptors): what a
third-party library prints inside `quiet()` - C-level writes, print, stderr, a `vllm.*` log record, a Python
warning - lands in the log file; the terminal gets our lines and the one line saying where the log is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, os, sys, warnings
from peagle_pipeline.backends import vllm_log

vllm_log.route_to(sys.argv[1])
with vllm_log.quiet():
    vllm_log.announce()  # (an engine start inside quiet(): still to the terminal)
    vllm_log.announce()  # once per file
    os.write(1, b"c-level noise\\n")
    print("python noise")
    sys.stderr.write("stderr noise\\n")
    with vllm_log.quiet():  # nested: the same file
        logging.getLogger("vllm.engine").warning("a vllm warning")
    warnings.warn("a deprecation", FutureWarning)
print("ours")
logging.getLogger("vllm.worker").warning("a vllm warning outside quiet()")
"""


def test_third_party_output_goes_to_the_log_file(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    log_file = tmp_path / "vllm.log"
    assert proc.stdout == "ours\n"
    assert proc.stderr == f"vLLM's own messages go to {log_file}\n"
    text = log_file.read_text()
    for line in ("c-level noise", "python noise", "stderr noise", "a vllm warning", "a deprecation"):
        assert line in text, text
    assert "a vllm warning outside quiet()" in text
