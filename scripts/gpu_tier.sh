#!/usr/bin/env bash
# The GPU tier in one go, on a CUDA machine whose python3 already has torch, with or without network (docs/guides/gpus.md):
#   1. `pip install` our wheel with the resolver but no index, missing dependencies from .whl/ (made by
#      scripts/gpu_wheels.sh): it must install only what is missing and keep the machine's torch; the CLI must run;
#   2. `pytest -m gpu tests/gpu` (flex mask = dense SDPA, bf16 + DDP of one process, CUDA extraction = CPU fp32
#      cache, partition memory at 8k/16k/32k);
#   3. the figures: `python -m bench.bench_gpu`, and `-m bench.bench_speculators --device cuda` when speculators imports.
# Everything lands in $OUT (default gpu-tier-out/): install.json, pip-report.json, pytest.log, junit.xml,
# gpu.json, speculators_gpu.json, bench.log. Exit status: non-zero when any step failed (all steps still run).
#     OUT=/tmp/out bash scripts/gpu_tier.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-tier-out}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BENCH_WHEELS=${BENCH_WHEELS:-.whl-speculators}
QUICK=${1:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
status=0
step() { echo; echo "### $*"; }

step "1. install beside the machine's torch"
probe='import json, torch, transformers; print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.cuda.is_available(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}))'
before=$("$PY" -c "$probe")
echo "before: $before"
wheel=$(ls "$WHEELS"/peagle_pipeline-*.whl 2>/dev/null | head -1)
if [[ -z "$wheel" ]]; then
  echo "no $WHEELS/peagle_pipeline-*.whl: run scripts/gpu_wheels.sh (on a machine with network) and copy .whl here"; exit 2
fi
"$PY" -m pip install --no-index --find-links "$WHEELS" --no-compile --report "$OUT/pip-report.json" "$wheel" || status=1
after=$("$PY" -c "$probe")
echo "after:  $after"
# From / so that the installed package runs, not this checkout's sources.
cli=$(cd / && "$PY" -m peagle_pipeline.cli --help >/dev/null 2>&1 && echo ok || echo failed)
"$PY" - "$OUT" "$before" "$after" "$cli" <<'PYEOF' || status=1
import json, sys
out, before, after, cli = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
try:
    report = json.load(open(f"{out}/pip-report.json"))
    installed = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report["install"]]
except (OSError, ValueError, KeyError):
    installed = None
res = {"before": before, "after": after, "torch_kept": before["torch"] == after["torch"], "pip_installed": installed,
       "cli_help": cli}
json.dump(res, open(f"{out}/install.json", "w"), indent=2)
print(json.dumps(res, indent=2))
sys.exit(0 if res["torch_kept"] and cli == "ok" and installed is not None else 1)
PYEOF

if [[ -f "$BENCH_WHEELS/speculators-carry.txt" ]]; then
  # speculators and what it needs that this machine lacks (scripts/gpu_wheels.sh --speculators), --no-deps as in
  # make setup-bench: its metadata wants torchvision/torchaudio, and what is installed here stays as it is.
  step "1b. speculators (comparator only)"
  { "$PY" -m pip install -q --no-index --no-deps --find-links "$BENCH_WHEELS" --no-compile \
      $("$PY" scripts/wheel_closure.py missing "$BENCH_WHEELS/speculators-carry.txt") &&
    (cd / && "$PY" -c "import speculators, speculators.models.peagle, speculators.losses"); } \
    || echo "speculators did not install or import: no speculators figure"
fi

step "2. pytest -m gpu tests/gpu"
"$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rs --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "3. figures"
(
  s=0
  "$PY" -m bench.bench_gpu --out "$OUT/gpu.json" ${QUICK:+--quick} || s=1
  if "$PY" -c "import speculators" 2>/dev/null; then
    "$PY" -m bench.bench_speculators --device cuda --tokens "$([[ -n "$QUICK" ]] && echo 1024 || echo 8192)" \
      --repeat 3 --out "$OUT/speculators_gpu.json" || s=1
  else
    echo "speculators not installed (scripts/gpu_wheels.sh --speculators): no our-step-vs-speculators figure"
  fi
  exit $s
) 2>&1 | tee "$OUT/bench.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device here: the GPU tests were skipped and no figure was measured"
  [[ $status -ne 0 ]] || status=3
fi
echo; echo "GPU tier finished with status $status; results in $OUT"
exit $status
