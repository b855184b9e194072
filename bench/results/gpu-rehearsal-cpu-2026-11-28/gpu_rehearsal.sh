#!/usr/bin/env bash
# The calls of docs/results/gpu-runs.md ("The next lent GPU"), in their order, on the CPU: a fresh .venv-gpu312 (as
# the lent machine: no zarr stack), then stage-a, go, go, the profile, gen-bench, each with DEVICE=cpu (REHEARSE=1)
# and toy sizes. Figures mean nothing; each call's exit status and files do.
cd "$(dirname "$0")/../../.."  # the repository root
bash scripts/gpu_rehearsal_env.sh || exit 1
export PYTHON=.venv-gpu312/bin/python WORK=/tmp/gq-rehearse DEVICE=cpu REHEARSE=1
export MAX_SAMPLES=24 OFF_SAMPLES=24 MAX_NEW=32 GEN_SECONDS=240 TRAIN_END=560 RANKS=1 TOKENS_PER_STEP=2048 EPOCHS=2
export EVAL_SETS=mtbench EVAL_NEW=16 GEN_CHUNK=8 GEN_BATCH=8 BENCH_PROMPTS=16 PLAIN_BATCH=8 VARIANTS="l2=--draft-layers 2"
rm -rf "$WORK" .scratch/rehearse-out
call() {  # call NAME COMMAND...: one device call, its own empty $OUT
  export OUT=$PWD/.scratch/rehearse-out/$1
  mkdir -p "$OUT"
  echo "== $1"
  local t0=$SECONDS
  "${@:2}"
  echo "== $1: rc=$? in $((SECONDS - t0)) s; files: $(ls -A "$OUT" | tr '\n' ' ')"
}
call stage-a bash experiments/gpu_quality.sh stage-a
call go1 bash experiments/gpu_quality.sh go 900
call go2 bash experiments/gpu_quality.sh go 30
call profile bash experiments/gpu_profile.sh
call gen-bench bash experiments/gpu_quality.sh gen-bench
