#!/usr/bin/env bash
# gpu_quality.sh's verbs on the CPU, in .venv-gpu312, at toy sizes (figures mean nothing)
cd "$(dirname "$0")/../../.."  # the repository root
export PYTHON=.venv-gpu312/bin/python WORK=/tmp/gq-rehearse OUT=$PWD/.scratch/rehearse-gq DEVICE=cpu
export MAX_SAMPLES=24 OFF_SAMPLES=24 MAX_NEW=32 GEN_SECONDS=240 TRAIN_END=560 RANKS=1 TOKENS_PER_STEP=2048 EPOCHS=2
export EVAL_SETS=mtbench EVAL_NEW=16 GEN_CHUNK=8 GEN_BATCH=8 BENCH_PROMPTS=16 PLAIN_BATCH=8 VARIANTS="l2=--draft-layers 2"
echo "== stage-a"; time bash experiments/gpu_quality.sh stage-a; echo "rc=$?"
echo "== gen-bench"; time bash experiments/gpu_quality.sh gen-bench; echo "rc=$?"
echo "== go 900"; time bash experiments/gpu_quality.sh go 900; echo "rc=$?"
echo "== go 30"; time bash experiments/gpu_quality.sh go 30; echo "rc=$?"
ls -la "$OUT"
