#!/bin/bash
# How much slower each `make quality` stage is in fp32 (a host without bf16 units computes in fp32) than in bf16, on
# this host's cores: PEAGLE_CPU_BF16=0 makes the package choose fp32. Needs a finished `make quality` (.quality).
#   scripts/fp32_stage_ratios.sh [WORK_DIR]     (about 8 minutes on 2 cores; docs/quality-notes.md has the figures)
# generate and evaluate run both ways on the same slice; extract and train run in fp32 only, to compare with the
# tokens/s that the run's own bf16 logs show (extraction ~578, training ~1,515 here).
set -u
cd "$(dirname "$0")/.."
D=${1:-.scratch/fp32}
M=.demo/models/SmolLM2-135M-Instruct
for need in .quality/data/train_sources.jsonl .quality/caches/on-multi .quality/runs/main/export/config.json; do
  [ -e "$need" ] || { echo "error: $need is missing: run make quality first" >&2; exit 2; }
done
mkdir -p "$D"
head -n 100 .quality/data/train_sources.jsonl > "$D/src100.jsonl"
head -n 60 .quality/data/train_sources.jsonl > "$D/src60.jsonl"
for mode in 1 0; do
  export PEAGLE_CPU_BF16=$mode
  rm -rf "$D/gen-$mode" "$D/ev-$mode"
  /usr/bin/time -f "generate PEAGLE_CPU_BF16=$mode: %e s" .venv-vllm/bin/peagle-pipeline generate --model $M \
    --data "$D/src100.jsonl" --output "$D/gen-$mode" --backend vllm --turns first --max-new-tokens 160 \
    --max-prompt-tokens 768 --seed 0 --chunk-size 256 --temperature 0 --top-p 1.0 2>&1 \
    | tr '\r' '\n' | grep -a "100/100 conversations\|^generate PEAGLE" | tail -2
  /usr/bin/time -f "evaluate PEAGLE_CPU_BF16=$mode: %e s" .venv-vllm/bin/peagle-pipeline evaluate \
    .quality/runs/main/export --target $M --prompts mt-bench --num-prompts 16 --max-tokens 64 --temperature 0 \
    --depths 4 --concurrency 16 --acceptance-concurrency 16 --output "$D/ev-$mode" 2>&1 | grep -a "^evaluate PEAGLE"
done
export PEAGLE_CPU_BF16=0
rm -rf "$D/cache" "$D/run"
.venv/bin/peagle-pipeline extract --data "$D/src60.jsonl" --model $M --output "$D/cache" --topk 32 --max-length 1024 \
  --batch-tokens 4096 --dtype bf16 2>&1 | tr '\r' '\n' | grep -a "60/60" | tail -1
.venv/bin/peagle-pipeline train --cache .quality/caches/on-multi --output "$D/run" --draft-vocab-size 8192 \
  --tokens-per-step 1024 --steps 100 --lr 2e-3 --warmup 10 --loss-positions all --eval-samples 32 \
  --down-sample-ratio 0.3 --down-sample-ratio-min 0.05 --log-every 25 --num-workers 1 --no-export 2>&1 \
  | grep -a "step 100/100"
echo "evaluate reports (wall_seconds, AL): $D/ev-1/report.json (bf16), $D/ev-0/report.json (fp32)"
