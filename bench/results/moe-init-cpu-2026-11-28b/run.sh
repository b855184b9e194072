#!/bin/bash
# The start not tried in ../moe-init-cpu-2026-11-28/: a mixture-of-experts target's last layer gives the draft its
# attention and norms, and the draft's MLP keeps its own random initialisation instead of starting at zero output.
# Same cache (the on-multi ablation row kept in .scratch/quality-1128a) and settings (600 steps); the new draft is
# measured in one evaluate run beside that study's three exports (kept in .scratch/moe-init), so all four share
# the run's numerics. AMD EPYC host, idle. Run from the repository root after that study's run.sh.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
Q=.scratch/quality-1128a
W=.scratch/moe-init
rm -rf "$W/attention-random-mlp"
date
# train in-process with the start's MLP put back to the draft's own random weights after the copy
.venv/bin/python - "$Q" "$W" <<'PY'
import sys

import peagle_pipeline.stages.train.draft as draft
from peagle_pipeline.cli import main

copy = draft.init_from_target_layer


def attention_with_random_mlp(model, tensors):
    mlp = {k: v.clone() for k, v in model.layers[0].mlp.state_dict().items()}
    copy(model, tensors)
    model.layers[0].mlp.load_state_dict(mlp)


draft.init_from_target_layer = attention_with_random_mlp
q, w = sys.argv[1], sys.argv[2]
main([
    "train", "-c", f"{q}/runs/on-multi/train.yaml", "--steps", "600", "--eval-every", "150", "--save-every", "600",
    "--cache", f"{w}/cache-attention", "--output", f"{w}/attention-random-mlp",
])
PY
date
.venv-vllm/bin/python -m peagle_pipeline.cli evaluate "$W/full/export" "$W/attention/export" \
  "$W/attention-random-mlp/export" "$W/random/export" \
  --target .demo/models/SmolLM2-135M-Instruct --prompts mt-bench --prompts "$Q/data/heldout_prompts.jsonl" \
  --num-prompts 80 --max-tokens 64 --temperature 0 --depths 4 --output "$W/eval-b" \
  --concurrency 16 --acceptance-concurrency 16
date
