"""A 20 MB single-conversation line through the real `extract` CLI: peak memory stays bounded by the max length
(it was tokenised whole before truncation; 50 MB took 9.6 GB and 114 s)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_argv import PEAGLE

pytestmark = pytest.mark.slow

# Runs its argv as a child and prints the child's peak RSS (KiB): this wrapper's only child is the CLI.
PEAK_RSS = (
    "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)"
)


def _extract_peak_mib(model: Path, data: Path, out: Path, env: dict[str, str]) -> tuple[float, float]:
    argv = [*PEAGLE, "extract", "--model", str(model), "--data", str(data), "--output", str(out)]
    argv += ["--max-length", "256", "--dtype", "fp32"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, *argv], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip().splitlines()[-1]) / 1024, time.perf_counter() - t0


def test_a_20mb_conversation_needs_little_more_memory_than_a_small_one(tiny_model, tmp_path, cli_env):
    env = dict(cli_env, TQDM_DISABLE="1")
    small = tmp_path / "small.jsonl"
    big = tmp_path / "big.jsonl"
    chat = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "once upon a time"},
    ]
    small.write_text(json.dumps({"messages": chat}) + "\n")
    words = "the quick brown fox jumps over the lazy dog and speculative decoding drafts tokens ".split()
    text = " ".join(words[i % len(words)] for i in range(3_400_000))  # ~20 MB: one huge reply
    big.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "tell me everything"},
                    {"role": "assistant", "content": text},
                ]
            }
        )
        + "\n"
    )
    assert big.stat().st_size > 20e6
    base, _ = _extract_peak_mib(tiny_model, small, tmp_path / "c-small", env)
    peak, seconds = _extract_peak_mib(tiny_model, big, tmp_path / "c-big", env)
    print(f"\npeak RSS: small line {base:.0f} MiB, 20 MB line {peak:.0f} MiB ({seconds:.1f} s)")
    assert peak - base < 400, (base, peak)  # the line itself and a few copies of it; not its ~8 M tokens
    from peagle_pipeline.cache.reader import open_cache

    cache = open_cache(tmp_path / "c-big")
    assert cache.samples["length"].tolist() == [256] and bool(cache.samples["truncated"][0])
