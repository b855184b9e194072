#!/bin/bash
# The on-multi ablation row with its cache cut at 384 tokens instead of 512 (equal steps), measured beside the 512
# row of the run then in .quality (make quality of 2026-11-27 22:59, b677520) in one evaluate run, 2026-11-28 00:46 to
# 00:55 UTC on the AMD EPYC host, idle. Run from the repository root with that run in .quality.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
date
.venv/bin/python -m peagle_pipeline.cli extract --data .quality/onpolicy/multi-sampled \
  --model .demo/models/SmolLM2-135M-Instruct --output .scratch/on-multi-384 --topk 32 --max-length 384 --batch-tokens 4096
date
.venv/bin/python -m peagle_pipeline.cli train -c .quality/runs/on-multi/train.yaml \
  --cache .scratch/on-multi-384 --output .scratch/row-on-multi-384
date
.venv-vllm/bin/python -m peagle_pipeline.cli evaluate .quality/runs/on-multi/export .scratch/row-on-multi-384/export \
  --target .demo/models/SmolLM2-135M-Instruct --prompts mt-bench --prompts .quality/data/heldout_prompts.jsonl \
  --num-prompts 80 --max-tokens 64 --temperature 0 --depths 4 --output .scratch/row384-eval \
  --concurrency 16 --acceptance-concurrency 16
date
