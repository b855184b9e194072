#!/bin/bash
# How much longer each `make quality` stage takes in fp32 (what the package computes in on a host without bf16
# units) than in bf16, on this host's cores: PEAGLE_CPU_BF16=0 makes the package choose fp32. Every stage runs the
# same slice both ways with the run's own settings. Needs a finished `make quality` in QUALITY_DIR (its sources,
# on-multi cache, main draft).
#   experiments/fp32_stage_ratios.sh [WORK_DIR] [QUALITY_DIR]   (about 11 minutes on 2 cores; docs/results/what-we-learned.md)
#   SUMMARY_ONLY=1 experiments/fp32_stage_ratios.sh [WORK_DIR]    (the table again, from WORK_DIR's logs)
set -u
cd "$(dirname "$0")/.."
D=${1:-.scratch/fp32}
Q=${2:-.quality}
M=.demo/models/SmolLM2-135M-Instruct
# timed NAME MODE CMD...: run CMD with PEAGLE_CPU_BF16=MODE, log to $D/NAME-MODE.log, record the seconds.
timed() {
  local name=$1 mode=$2
  shift 2
  local t0 t1
  t0=$(date +%s.%N)
  PEAGLE_CPU_BF16=$mode "$@" > "$D/$name-$mode.log" 2>&1 || { echo "error: $name (PEAGLE_CPU_BF16=$mode) failed: $D/$name-$mode.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  awk -v n="$name" -v m="$mode" -v a="$t0" -v b="$t1" 'BEGIN {print n, m, b - a}' >> "$D/times.txt"
}

# The stages' own throughput (engine start and model load excluded; the whole-command seconds include them and
# a cold start of the first command in an environment): generate's and extract's tokens/s, train's tokens/s at
# its last step, and evaluate's wall seconds (its engines' starts and every decode).
summary() {
  echo "stage     figure           bf16      fp32   fp32/bf16 time (whole command: bf16 s, fp32 s)"
  local stage pat kind b f wb wf
  for stage in generate extract train evaluate; do
    case $stage in
      generate) pat='[0-9.]+ tokens/s after'; kind=speed ;;
      extract) pat='[0-9.]+ tokens/s\)'; kind=speed ;;
      train) pat='step 100/100.* [0-9.]+ tok/s'; kind=speed ;;
      evaluate) kind=time ;;
    esac
    if [ $stage = evaluate ]; then
      b=$(grep -o '"wall_seconds": [0-9.]*' "$D/ev-1/report.json" | grep -o '[0-9.]*$')
      f=$(grep -o '"wall_seconds": [0-9.]*' "$D/ev-0/report.json" | grep -o '[0-9.]*$')
    else
      b=$(tr '\r' '\n' < "$D/$stage-1.log" | grep -aoE "$pat" | tail -1 | grep -oE '[0-9.]+ tok' | grep -oE '[0-9.]+')
      f=$(tr '\r' '\n' < "$D/$stage-0.log" | grep -aoE "$pat" | tail -1 | grep -oE '[0-9.]+ tok' | grep -oE '[0-9.]+')
    fi
    wb=$(awk -v s=$stage '$1 == s && $2 == 1 {print $3}' "$D/times.txt")
    wf=$(awk -v s=$stage '$1 == s && $2 == 0 {print $3}' "$D/times.txt")
    awk -v s=$stage -v k=$kind -v b="$b" -v f="$f" -v wb="$wb" -v wf="$wf" 'BEGIN {
      r = (k == "speed") ? b / f : f / b
      printf "%-9s %-14s %8.1f  %8.1f   %.2fx   (%.0f s, %.0f s)\n", s, (k == "speed") ? "tokens/s" : "seconds", b, f, r, wb, wf
    }'
  done
  echo "logs: $D/*.log; evaluate reports (AL): $D/ev-1/report.json (bf16), $D/ev-0/report.json (fp32)"
}
if [ "${SUMMARY_ONLY:-0}" = 1 ]; then  # re-print the table from an earlier run's logs
  summary
  exit 0
fi

for need in "$Q/data/train_sources.jsonl" "$Q/caches/on-multi" "$Q/runs/main/export/config.json"; do
  [ -e "$need" ] || { echo "error: $need is missing: run make quality first" >&2; exit 2; }
done
mkdir -p "$D"
head -n 100 "$Q/data/train_sources.jsonl" > "$D/src100.jsonl"
head -n 60 "$Q/data/train_sources.jsonl" > "$D/src60.jsonl"

rm -f "$D/times.txt"
for mode in 1 0; do
  rm -rf "$D/gen-$mode" "$D/ev-$mode" "$D/cache-$mode" "$D/run-$mode"
  timed generate $mode .venv-vllm/bin/peagle-pipeline generate --model $M --data "$D/src100.jsonl" \
    --output "$D/gen-$mode" --backend vllm --turns first --max-new-tokens 160 --max-prompt-tokens 768 --seed 0 \
    --chunk-size 256 --temperature 0 --top-p 1.0
  timed evaluate $mode .venv-vllm/bin/peagle-pipeline evaluate "$Q/runs/main/export" --target $M \
    --prompts mt-bench --num-prompts 16 --max-tokens 64 --temperature 0 --depths 4 --concurrency 16 \
    --acceptance-concurrency 16 --output "$D/ev-$mode"
  timed extract $mode .venv/bin/peagle-pipeline extract --data "$D/src60.jsonl" --model $M \
    --output "$D/cache-$mode" --topk 32 --max-length 1024 --batch-tokens 4096 --dtype bf16
  timed train $mode .venv/bin/peagle-pipeline train --cache "$Q/caches/on-multi" --output "$D/run-$mode" \
    --draft-vocab-size 8192 --tokens-per-step 1024 --steps 100 --lr 2e-3 --warmup 10 --loss-positions all \
    --eval-samples 32 --down-sample-ratio 0.3 --down-sample-ratio-min 0.05 --log-every 25 --num-workers 1 --no-export
done
summary
