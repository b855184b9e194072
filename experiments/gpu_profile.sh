#!/usr/bin/env bash
# Issue 37's GPU profile in one go (about 4 minutes), on a GPU machine whose python3 has CUDA torch (docs/guides/gpus.md):
#   0. the zarr stack (and speculators, when carried) from .whl/ with --no-deps: the machine's torch stays; this
#      checkout runs from its sources (PYTHONPATH), no wheel of ours is built or installed;
#   1. experiments/gpu_profile.py: torch.profiler traces and host-sync counts of our P-EAGLE step and speculators'
#      (2,048 tokens, bf16) and of HF extraction vs the bare forward (random SmolLM2-sized target);
#   2. python -m bench.bench_extract --size 8b: extraction vs bare forward tokens/s on a random Llama-3.1-8B-sized target
#      (4 of its layers, so that it builds in seconds);
#   3. python -m bench.bench_data_wait on a cache extracted here (random SmolLM2-sized target, tiny test tokenizer):
#      the data-wait share of the step time on the GPU.
# Raw output: $OUT/gpu-<card>-<date>/ (default OUT=bench/results): profile.json, trace_*.json.gz, top_*.txt,
# extract_8b.json, data_wait.json, *.log. Each step has its own time limit; a failed step does not stop the others.
#     OUT=/tmp/out bash experiments/gpu_profile.sh
# With this workplace's device tool: run(command="OUT=$OUT bash experiments/gpu_profile.sh", carry=[".whl"]).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
card=$("$PY" -c 'import torch; print(torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else "cpu")')
RES="${OUT:-bench/results}/gpu-$card-$(date -u +%F)"
mkdir -p "$RES"
status=0
step() { echo; echo "### $*"; }
if [[ "$card" == "cpu" ]]; then
  echo "no CUDA device: nothing to profile"; exit 3
fi

step "0. dependencies from $WHEELS (--no-deps; torch untouched)"
extra=$(ls "$WHEELS"/*.whl 2>/dev/null | grep -v peagle_pipeline || true)
if [[ -n "$extra" ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile $extra 2>&1 | tail -3 || status=1
fi
"$PY" -c "import zarr" || { echo "zarr does not import: run scripts/gpu_wheels.sh here and carry .whl"; status=1; }

step "1. profiles (our step, speculators' step, extraction vs bare forward)"
timeout 100 "$PY" experiments/gpu_profile.py --out "$RES" --tokens 2048 --precision bf16 2>&1 | tee "$RES/profile.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "2. extraction vs bare forward, 8B-sized target (4 layers)"
timeout 45 "$PY" -m bench.bench_extract --size 8b --layers 4 --device cuda --samples 24 --max-length 2048 \
  --batch-tokens 16384 --group 2 --out "$RES/extract_8b.json" 2>&1 | tee "$RES/extract_8b.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "3. data wait on the GPU"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
timeout 85 bash -c '
  set -e
  "$0" - "$1" <<PYEOF
import sys
from pathlib import Path
from bench.bench_gpu import random_target
from bench.tiny import build_tokenizer, write_conversations
work = Path(sys.argv[1])
build_tokenizer(random_target(work / "target", layers=30))
write_conversations(work / "conv.jsonl", 96, max_reply_words=600)
PYEOF
  "$0" -m peagle_pipeline.cli extract --model "$1/target" --data "$1/conv.jsonl" --output "$1/cache" \
    --max-length 2048 --batch-tokens 16384 --device cuda
  "$0" -m bench.bench_data_wait --cache "$1/cache" --steps 16 --log-every 4 --tokens-per-step 8192 \
    --num-workers 2 --out "$2/data_wait.json"
' "$PY" "$work" "$RES" 2>&1 | tee "$RES/data_wait.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

echo; echo "GPU profile finished with status $status; results in $RES"
ls -la "$RES"
exit $status
