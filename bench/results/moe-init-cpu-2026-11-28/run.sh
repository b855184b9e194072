#!/bin/bash
# How a draft that starts from the target's last layer without its MLP (what a mixture-of-experts target such as
# gpt-oss or Qwen3-MoE gives: attention and norms copied, the draft's MLP at zero output) compares with the full
# start and with random weights, on SmolLM2 (dense, so all three can run): the on-multi ablation row of the
# make quality run kept in .scratch/quality-1128a (2026-11-28 00:56, 384 tokens), 600 steps each, the three exports
# measured in one evaluate run. AMD EPYC host, idle. Run from the repository root.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
Q=.scratch/quality-1128a
W=.scratch/moe-init
rm -rf "$W" && mkdir -p "$W"
# the cache without the stored layer's MLP: hard links, and a pieces file written anew without mlp.* tensors
cp -al "$Q/caches/on-multi" "$W/cache-attention"
rm "$W/cache-attention/target/pieces.safetensors"
.venv/bin/python - "$Q/caches/on-multi/target/pieces.safetensors" "$W/cache-attention/target/pieces.safetensors" <<'PY'
import sys
from safetensors import safe_open
from safetensors.torch import save_file
with safe_open(sys.argv[1], framework="pt") as f:
    kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("init_layer.mlp.")}
    meta = f.metadata()
save_file(kept, sys.argv[2], metadata=meta)
print("kept", len(kept), "tensors")
PY
common=(-c "$Q/runs/on-multi/train.yaml" --steps 600 --eval-every 150 --save-every 600)
date
.venv/bin/python -m peagle_pipeline.cli train "${common[@]}" --cache "$Q/caches/on-multi" --output "$W/full"
date
.venv/bin/python -m peagle_pipeline.cli train "${common[@]}" --cache "$W/cache-attention" --output "$W/attention"
date
.venv/bin/python -m peagle_pipeline.cli train "${common[@]}" --no-init-from-target --cache "$Q/caches/on-multi" --output "$W/random"
date
.venv-vllm/bin/python -m peagle_pipeline.cli evaluate "$W/full/export" "$W/attention/export" "$W/random/export" \
  --target .demo/models/SmolLM2-135M-Instruct --prompts mt-bench --prompts "$Q/data/heldout_prompts.jsonl" \
  --num-prompts 80 --max-tokens 64 --temperature 0 --depths 4 --output "$W/eval" \
  --concurrency 16 --acceptance-concurrency 16
date
