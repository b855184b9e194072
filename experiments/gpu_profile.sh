#!/usr/bin/env bash
# The GPU profile in one go (about 4 minutes), on a CUDA machine whose python3 has torch (docs/guides/gpus.md), with
# or without network:
#   0. what the machine lacks of the zarr stack (.whl/) and of speculators' closure (.whl-speculators/), with
#      --no-deps: a distribution the machine has, in any version, stays as it is (its torch, and a huggingface-hub 1.x
#      under a transformers 5.x that refuses to import beside 2.x); this checkout runs from its sources
#      (PYTHONPATH), no wheel of ours is built or installed;
#   1. experiments/gpu_profile.py: torch.profiler traces and host-sync counts of our P-EAGLE step and speculators'
#      (2,048 tokens, bf16) and of HF extraction vs the bare forward (random SmolLM2-sized target);
#   2. python -m bench.bench_extract --size 8b: extraction vs bare forward tokens/s on a random Llama-3.1-8B-sized target
#      (4 of its layers, so that it builds in seconds);
#   3. python -m bench.bench_data_wait on a cache extracted here (random SmolLM2-sized target, tiny test tokenizer):
#      the data-wait share of the step time on the GPU.
# Raw output: $OUT/gpu-<card>-<date>/ (default OUT=bench/results): profile.json, extract_8b.json, data_wait.json,
# logs.txt (every step's log), top.txt (the costliest ops of each profiled run), traces.tar (trace_*.json.gz).
# Each step has its own time limit; a failed step does not stop the others. The wheel folders come from
# scripts/gpu_wheels.sh --speculators on a machine with network (WHEELS, BENCH_WHEELS: other folders).
#     OUT=/tmp/out bash experiments/gpu_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BENCH_WHEELS=${BENCH_WHEELS:-.whl-speculators}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
card=$("$PY" -c 'import torch; print(torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else "cpu")')
status=0
step() { echo; echo "### $*"; }
# The sizes and time limits of a GPU run. REHEARSE=1 runs every step on the CPU at toy sizes and generous limits (the
# figures mean nothing): a check, in a venv like the GPU machine's (scripts/gpu_rehearsal_env.sh), that the steps and
# the install still work before GPU time is spent on them.
DEVICE=cuda LIMITS=(100 45 85)
PROFILE=(--tokens 2048)
E8B=(--samples 24 --max-length 2048 --batch-tokens 16384 --group 2)
DW_CONV=96 DW_LEN=2048 DW_STEPS=16 DW_TOKENS=8192
if [[ -n ${REHEARSE:-} ]]; then
  card=cpu-rehearsal DEVICE=cpu LIMITS=(600 300 300)
  PROFILE=(--tokens 256 --batches 2 --batch-tokens 1024 --max-length 512)
  E8B=(--samples 2 --max-length 256 --batch-tokens 512 --group 1)
  DW_CONV=8 DW_LEN=512 DW_STEPS=4 DW_TOKENS=1024
elif [[ "$card" == "cpu" ]]; then
  echo "no CUDA device: nothing to profile (REHEARSE=1 checks the steps on the CPU)"; exit 3
fi
RES="${OUT:-bench/results}/gpu-$card-$(date -u +%F)"
mkdir -p "$RES"

step "0. what the machine lacks, from $WHEELS and $BENCH_WHEELS (--no-deps; what it has stays)"
extra=$("$PY" scripts/wheel_closure.py missing-wheels "$WHEELS" "$BENCH_WHEELS" --skip peagle-pipeline 2>/dev/null)
if [[ -n "$extra" ]]; then
  echo "installing: $(for w in $extra; do basename "$w"; done | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile $extra 2>&1 | tail -3 || status=1
fi
"$PY" -c "import zarr, transformers" || { echo "zarr or transformers does not import: run scripts/gpu_wheels.sh on a machine with network and copy .whl here"; status=1; }

step "1. profiles (our step, speculators' step, extraction vs bare forward)"
timeout "${LIMITS[0]}" "$PY" experiments/gpu_profile.py --out "$RES" --device "$DEVICE" "${PROFILE[@]}" --precision bf16 2>&1 | tee "$RES/profile.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "2. extraction vs bare forward, 8B-sized target (4 layers)"
timeout "${LIMITS[1]}" "$PY" -m bench.bench_extract --size 8b --layers 4 --device "$DEVICE" "${E8B[@]}" \
  --out "$RES/extract_8b.json" 2>&1 | tee "$RES/extract_8b.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "3. data wait on the GPU"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
timeout "${LIMITS[2]}" bash -c '
  set -e
  "$0" - "$1" "$7" <<PYEOF
import sys
from pathlib import Path
from bench.bench_gpu import random_target
from bench.tiny import build_tokenizer, write_conversations
work = Path(sys.argv[1])
build_tokenizer(random_target(work / "target", layers=30))
write_conversations(work / "conv.jsonl", int(sys.argv[2]), max_reply_words=600)
PYEOF
  "$0" -m peagle_pipeline.cli extract --model "$1/target" --data "$1/conv.jsonl" --output "$1/cache" \
    --max-length "$4" --batch-tokens 16384 --device "$3"
  "$0" -m bench.bench_data_wait --cache "$1/cache" --steps "$5" --log-every 4 --tokens-per-step "$6" \
    --num-workers 2 --out "$2/data_wait.json"
' "$PY" "$work" "$RES" "$DEVICE" "$DW_LEN" "$DW_STEPS" "$DW_TOKENS" "$DW_CONV" 2>&1 | tee "$RES/data_wait.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

# Few files to copy back: the logs, the op tables and the traces each in one file.
(
  cd "$RES" || exit 0
  for f in *.log; do [[ -f $f ]] && { echo "===== $f"; cat "$f"; }; done >logs.txt && rm -f ./*.log
  for f in top_*.txt; do [[ -f $f ]] && { echo "===== $f"; cat "$f"; }; done >top.txt && rm -f top_*.txt
  ls trace_*.json.gz >/dev/null 2>&1 && tar -cf traces.tar trace_*.json.gz && rm -f trace_*.json.gz
)

echo; echo "GPU profile finished with status $status; results in $RES"
ls -la "$RES"
exit $status
