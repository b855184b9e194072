#!/bin/bash
# The on-multi ablation row with its cache cut at 512 tokens, like the off-policy rows (equal steps), measured beside
# the run's two ablation rows in one evaluate run. Run from the repository root after the run of 21:24 UTC.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
date
.venv/bin/python -m peagle_pipeline.cli extract --data .quality/onpolicy/multi-sampled \
  --model .demo/models/SmolLM2-135M-Instruct --output .scratch/on-multi-512 --topk 32 --max-length 512 --batch-tokens 4096
date
.venv/bin/python -m peagle_pipeline.cli train -c .quality/runs/on-multi/train.yaml \
  --cache .scratch/on-multi-512 --output .scratch/row-on-multi-512
date
.venv-vllm/bin/python -m peagle_pipeline.cli evaluate .quality/runs/on-multi/export .quality/runs/off-policy/export \
  .scratch/row-on-multi-512/export \
  --target .demo/models/SmolLM2-135M-Instruct --prompts mt-bench --prompts .quality/data/heldout_prompts.jsonl \
  --num-prompts 80 --max-tokens 64 --temperature 0 --depths 4 --output .scratch/row512-eval \
  --concurrency 16 --acceptance-concurrency 16
date
