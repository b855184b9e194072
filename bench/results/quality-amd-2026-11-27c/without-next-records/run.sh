#!/bin/bash
# The main draft without the off-policy-more cache, at the same steps, measured beside the run's main draft in one
# evaluate run. Run from the repository root after the run of 21:24 UTC.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
STEPS=$(grep '^  steps:' .quality/runs/main/train.yaml | awk '{print $2}')
echo "control: $STEPS steps"
date
.venv/bin/python -m peagle_pipeline.cli train -c .quality/runs/main/train.yaml \
  --output .scratch/control-main --extra-cache .quality/caches/off-policy --save-every "$STEPS" --keep-checkpoints 1
date
.venv-vllm/bin/python -m peagle_pipeline.cli evaluate .quality/runs/main/export .scratch/control-main/export \
  --target .demo/models/SmolLM2-135M-Instruct --prompts mt-bench --prompts .quality/data/heldout_prompts.jsonl \
  --num-prompts 80 --max-tokens 64 --temperature 0 --depths 4 --output .scratch/control-eval \
  --concurrency 16 --acceptance-concurrency 16
date
