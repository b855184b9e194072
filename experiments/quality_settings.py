"""`make quality`'s settings: where things are, the sizes at --scale 1, the training recipe every row shares, and
the small helpers every part of the experiment uses (experiments/quality.py runs it)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEARNED = REPO / "docs" / "results" / "what-we-learned.md"  # the page the report sends readers to
VENV_PY = REPO / ".venv" / "bin" / "python"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
MODEL = REPO / ".demo" / "models" / "SmolLM2-135M-Instruct"
SHAREGPT = REPO / ".demo" / "data" / "sharegpt.jsonl"
HELDOUT_FIRST_RECORD = 17_000  # ShareGPT records at or after this one are never trained on
# The data that carries the curve: `generate`'s default (every reply regenerated, sampled).
# Fixed rather than picked from the data rows' AL, so that every draft is measured in one `evaluate` run.
CARRIER = "on-multi"
# The main draft trains on the carrier and, through `train --extra-cache`, on the off-policy caches (+0.007 on MT-Bench,
# +0.016 held-out for the first one; docs/results/what-we-learned.md). Its held-out samples stay the carrier's, and
# train leaves the extra caches' samples of their prompts out of training, so its trainer estimate stays held-out.
# "off-policy" holds the carrier's records (the ablation's off-policy row, same prompts), "off-policy-more" the next
# `more_conversations` records, for the main draft only (the next `source_conversations` records read +0.026 MT-Bench
# AL for the main draft at equal steps, 2026-11-27; twice as many since every cache is cut at 384 tokens, which
# extracts a record in 0.58x the time). Every cache keeps each conversation's first `max_length` tokens (BASE). The
# single-turn row left the run on 2026-11-27: its cache is the carrier's first turns again, and it read within the
# noise of the multi-turn row (-0.006 and +0.004 MT-Bench AL in its last two runs).
MAIN_EXTRA = ("off-policy", "off-policy-more")

# Sizes at --scale 1. `--scale auto` (the default) sizes the run to BUDGET_MIN on this host: the data and step budgets
# scale, the evaluation (a fixed count of prompts, so that rows stay comparable) does not. Hosts of one class differ
# by 2x (35.7 min on an AMD EPYC in bf16, 68.1 on an Intel Xeon in fp32 at scale 1: docs/results/what-we-learned.md),
# and stage times follow the target's forward speed, so `auto` times that forward (`probe_tokens_per_s`) and scales
# the reference run's minutes by it: total(scale) = (fixed_min + per_scale_min x scale) x reference / probe.
# Reference: the Intel host's run at scale 1 in fp32 (2026-11-26, 68.1 min; docs/results/quality.md of that date) less
# the three rows since dropped: evaluation 13.9 min (5 drafts and the plain target at 1.74 min each, then 3.4 at
# concurrency 1), everything else 34.0 (39.0 less the single-turn row's extraction and training, 12.9 % of the scaled
# stages in the AMD host's run of 2026-11-27). The probe read 700 to 725 tokens/s on that host (2026-11-27).
# Since 2026-11-28 the main run's steps fill the minutes left after the stages before it
# (quality_sizing.size_main_run), so this model sets the scale of the data and the ablation only.
BUDGET_MIN = 60.0
BUDGET_MARGIN = 0.93  # aim below the budget: stage times move by several % between runs of one host
REFERENCE = {"probe_tokens_per_s": 715.0, "fixed_min": 13.9, "per_scale_min": 34.0}
SCALE_RANGE = (0.3, 3.0)
BASE = {
    "source_conversations": 400,
    "more_conversations": 800,  # the off-policy-more cache's records (the ones after the sources)
    "heldout_prompts": 80,  # 24 could not separate rows (docs/results/what-we-learned.md, "The held-out rows on 200 prompts")
    "mtbench_prompts": 80,
    "max_new_tokens": 160,
    # Every cache's samples cut here. MT-Bench and the held-out set measure a first turn and 64 new tokens (positions
    # below about 400). At equal steps the on-policy row at 512 read +0.024 / +0.026 AL over the same data at 1,024
    # (2026-11-27, bench/results/quality-amd-2026-11-27c/on-multi-512/), and at 384 -0.008 / +0.015 against 512,
    # level, from 0.58x the extraction time (2026-11-28, bench/results/quality-amd-2026-11-28/on-multi-384/): the
    # minutes saved buy more records. `generate` takes it as its `max_prompt_tokens`: a reply that would start past
    # the cut is not generated (at 768 and a cut at 512, 14 % of the generated tokens were such replies).
    "max_length": 384,
    "ablation_steps": 200,
    "main_steps": 1800,  # under `--scale auto` the main run's steps fill the minutes left instead (quality_sizing)
    "curve_points": 3,
    "eval_max_tokens": 64,
    "speed_prompts": 40,
    "generate_chunk": 256,  # conversations in flight per `generate` chunk: larger waves batch better in vLLM
}
# The ablation's AL is read from runs with this many requests in flight (the same AL up to numerics, several times
# faster than one prompt at a time on a CPU); the main draft is also measured at concurrency 1 (the
# headline AL and the speedup a single user sees), which shows how close the two are.
EVAL_CONCURRENCY = 16
DEFAULT_DIR, DEFAULT_DOC = ".quality", "docs/results/quality.md"
# The trainer's held-out estimates per training run (per saved checkpoint for the learning curve).
EVALS_PER_RUN = 4
TRAIN = {  # shared by every row; a row changes one thing
    "draft_layers": 1,
    "depths": 4,
    "draft_vocab_size": 8192,
    "tokens_per_step": 1024,
    "lr": 2e-3,
    "loss_positions": "all",  # every cached position teaches (the "loss on the replies only" row is the ablation)
    # COD keeps 1 + 0.3 + 0.09 + 0.05 = 1.4 elements per anchor instead of the default 2.5 (0.7 / 0.2): depths >= 1
    # return little at this size, and the cheaper steps buy 1.7x the steps in the same time (+0.027 AL at equal
    # time, docs/results/what-we-learned.md).
    "down_sample_ratio": 0.3,
    "down_sample_ratio_min": 0.05,
    "warmup": 10,
    "schedule": "cosine",
    "eval_samples": 32,
    "num_workers": 1,
    "log_every": 25,
    # The fused layer starts as the target's last layer, fc as a pass-through (the package default since
    # 2026-11-24; +0.049 AL at the main budget, docs/results/what-we-learned.md). Named so the report states it.
    "init_from_target": True,
}
# top-p stays 1.0: vLLM's CPU sampler sorts the whole vocabulary of every sequence at every step for top-p < 1,
# which made sampled regeneration ~1.7x slower here (docs/results/what-we-learned.md).
SAMPLED = {"temperature": 0.7, "top_p": 1.0}


class QualityError(Exception):
    """A stage failed: one line, and the exit code to leave with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def say(text: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {text}", flush=True)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def ask_package(code: str) -> str:
    """What `code` prints when run by .venv's Python (the package is not importable in this interpreter)."""
    out = subprocess.run([str(VENV_PY), "-c", code], capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise QualityError(f"could not ask the package: {(out.stderr.strip().splitlines() or ['?'])[-1]}", 2)
    return out.stdout.strip()
