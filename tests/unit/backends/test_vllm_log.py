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


def test_the_error_line_of_a_dead_engine_is_the_last_one_written_during_the_call(tmp_path: Path) -> None:
    """`quiet()` names the last exception line the log got during the failed call: not one vLLM logged and recovered
    from before it (a chat-template warm-up's ValueError at every engine start), nor the EngineDeadError itself."""
    from peagle_pipeline.backends import vllm_log

    log = tmp_path / "vllm.log"
    log.write_text("ValueError: Tokenizer not available when `skip_tokenizer_init=True`\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("Traceback (most recent call last):\n  ...\nAttributeError: no attribute 'cpu_gemm_wna16'\n")
        f.write("RuntimeError: Worker failed with error 'no attribute cpu_gemm_wna16'\n")
        f.write("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    assert (
        vllm_log.last_error(log, start)
        == "RuntimeError: Worker failed with error 'no attribute cpu_gemm_wna16'"
    )
    assert vllm_log.last_error(log, log.stat().st_size).startswith("no error in its log (a process killed")


def test_a_config_validation_error_is_named_by_its_reason() -> None:
    """vLLM's config errors are pydantic's: "1 validation error for VllmConfig", then the reason on the next line."""
    from peagle_pipeline.backends.vllm import _reason

    text = (
        "1 validation error for VllmConfig\n  Value error, torch.float32 is not supported for quantization method "
        "awq. Supported dtypes: [torch.float16, torch.bfloat16] [type=value_error, input_value=ArgsKwargs((), {}), "
        "input_type=ArgsKwargs]\n    For further information visit https://errors.pydantic.dev/2.14/v/value_error"
    )
    assert _reason(ValueError(text)) == (
        "torch.float32 is not supported for quantization method awq. Supported dtypes: [torch.float16, torch.bfloat16]"
    )
    assert _reason(RuntimeError("first line\nsecond")) == "first line"
    assert _reason(OSError()) == "OSError"
