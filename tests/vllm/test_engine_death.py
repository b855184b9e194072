"""vLLM's engine process dying under `extract` (killed by a signal, as the kernel's OOM killer does, or failing inside
a kernel) ends the command with one line naming what vLLM's log says, exit 1: it ended with vLLM's EngineDeadError
traceback, whose cause only the log held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import SHAREGPT, TINY_LAYERS


def _engine_core(parent: int) -> int | None:
    """The pid of vLLM's engine-core process started by `parent`, if it runs yet."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"EngineCore" in cmdline:
                return int(entry.name)
    return None


def test_an_engine_killed_mid_extraction_ends_in_one_line(tiny_model: Path, tmp_path: Path, vllm_env) -> None:
    data = tmp_path / "chat.jsonl"
    with open(SHAREGPT, encoding="utf-8") as src:
        data.write_text("".join(line for _, line in zip(range(2000), src, strict=False)))
    exe = str(Path(sys.executable).parent / "peagle-pipeline")
    layers = ",".join(map(str, TINY_LAYERS))
    argv = [
        exe,
        "extract",
        "--model",
        str(tiny_model),
        "--data",
        str(data),
        "--output",
        str(tmp_path / "cache"),
    ]
    argv += ["--backend", "vllm", "--layers", layers, "--max-length", "256", "--dtype", "fp32"]
    # an engine process to kill (on a CPU, extract runs its engine in-process unless told otherwise)
    env = {**vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # type: ignore[union-attr]
            seen.append(line)
            if " samples, " in line:  # a progress line: the engine is running batches
                break
        core = _engine_core(proc.pid)
        assert core is not None, "".join(seen)[-3000:]
        os.kill(core, signal.SIGKILL)
        t0 = time.monotonic()
        _, rest = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + rest
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith("error: vLLM's engine stopped: no error in its log"), lines[-1]
    assert "vLLM's log: " in lines[-1] and time.monotonic() - t0 < 120
