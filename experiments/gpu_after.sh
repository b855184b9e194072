#!/usr/bin/env bash
# On the machine that has vLLM, after a GPU run of experiments/gpu_quality.sh (or gpu_profile.sh, gen-bench): keep the
# files of each results folder copied back from the GPU machine, join the export's parts and check them against the
# checksum the run wrote, and measure the draft in vLLM at the headline setting (MT-Bench and HumanEval, K = 4, T = 0,
# one request at a time, with speedup).
#
#   bash experiments/gpu_after.sh DEST NAME=DIR...
#     DEST        the results folder, e.g. bench/results/gpu-h200-2026-12-01 (raw files land in DEST/NAME/)
#     NAME=DIR    a name and a folder copied back from the GPU machine (its $OUT), in the order they were written:
#                 go1=... go2=... profile=... gen-bench=... (the export's parts may be spread over several)
#
# The joined export goes to .gpu/export/ (ignored: 86 MB of weights stay out of the repository); the parts are not
# copied into DEST. The target is the run's own: the GPU machine made it from the copied GGUF with its transformers,
# which may write other tokenizer and config bytes than this machine's (the same weights and token ids), and a draft
# is served only beside the target whose files it was trained on. So the target is made here the same way, with the
# GPU machine's versions (.venv-gpuver: `make test-gpu-versions` builds it), into .gpu/target/.
# Settings from the environment: TARGET (another target model directory), ALLOW_OTHER_TARGET=1 (evaluate beside a
# target whose files differ), EVAL=0 (join and check only), NUM_PROMPTS (per set; default all: 80 MT-Bench, 164
# HumanEval), MAX_TOKENS (64, as the last GPU run's measurement), VLLM_PY (.venv-vllm's python).
set -uo pipefail
cd "$(dirname "$0")/.."
say() { echo "[gpu-after $(date +%H:%M:%S)] $*"; }
(($# >= 2)) || { echo "usage: $0 DEST NAME=DIR... (e.g. go1=/path go2=/path)" >&2; exit 2; }
DEST=$1
shift
EXPORT=${EXPORT:-.gpu/export}
TARGET=${TARGET:-.gpu/target/models/SmolLM2-135M-Instruct}
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}

mkdir -p "$DEST" || exit 1
rm -rf "$EXPORT" && mkdir -p "$EXPORT" || exit 1
for spec in "$@"; do
  [[ $spec == *=* ]] || { say "error: '$spec' is not NAME=DIR"; exit 2; }
  call=${spec%%=*} dir=${spec#*=}
  [[ -d $dir ]] || { say "error: $call: no folder $dir"; exit 2; }
  mkdir -p "$DEST/$call"
  # every file of the folder, as it came (folders too: the profile's), but the weights' parts
  (cd "$dir" && find . -type f ! -name 'model.safetensors.part*' -print0) |
    while IFS= read -r -d '' f; do mkdir -p "$DEST/$call/$(dirname "$f")" && cp "$dir/$f" "$DEST/$call/$f"; done
  for f in "$dir"/model.safetensors.part* "$dir"/config.json "$dir"/.peagle-export.json "$dir"/sha256; do
    [[ -f $f ]] && cp "$f" "$EXPORT/"
  done
  say "$call: $(find "$dir" -type f | wc -l) files from $dir"
done

[[ -f $EXPORT/sha256 && -f $EXPORT/config.json ]] || { say "error: no folder holds the export's sha256 and config.json"; exit 1; }
parts=$(find "$EXPORT" -name 'model.safetensors.part*' | wc -l)
# the parts in their order (part0 .. part9, part10 .., or part000 ..): sort -V orders either numbering
find "$EXPORT" -name 'model.safetensors.part*' | sort -V | xargs -r cat >"$EXPORT/model.safetensors"
want=$(cut -d' ' -f1 "$EXPORT/sha256")
got=$(sha256sum "$EXPORT/model.safetensors" | cut -d' ' -f1)
if [[ $got != "$want" ]]; then
  say "error: the $parts parts joined do not give the export's sha256 (${want:0:12}...): a part is missing or damaged"
  exit 1
fi
rm -f "$EXPORT"/model.safetensors.part*
say "export joined from $parts parts, sha256 ${want:0:12}... as the run wrote: $EXPORT"
[[ ${EVAL:-1} == 0 ]] && exit 0

if [[ ! -f $TARGET/model.safetensors && $TARGET == .gpu/target/* ]]; then
  gguf=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'scripts'); from prepare_demo import find_gguf; print(find_gguf())") &&
    .venv-gpuver/bin/python scripts/prepare_demo.py --out .gpu/target --skip-data --gguf "$gguf" ||
    { say "error: could not make the run's target with .venv-gpuver (make test-gpu-versions builds it), or set TARGET"; exit 1; }
fi
[[ -d $TARGET ]] || { say "error: no target model at $TARGET"; exit 1; }
say "evaluate in vLLM: MT-Bench and HumanEval, K = 4, T = 0, concurrency 1 (log: $DEST/vllm-eval.txt)"
"$VLLM_PY" -m peagle_pipeline.cli evaluate "$EXPORT" --target "$TARGET" --prompts mt-bench --prompts humaneval \
  --num-prompts "${NUM_PROMPTS:-164}" --max-tokens "${MAX_TOKENS:-64}" --temperature 0 --depths 4 \
  --concurrency 1 --acceptance-concurrency 1 ${ALLOW_OTHER_TARGET:+--allow-other-target} --output "$DEST/vllm-eval" 2>&1 |
  tee "$DEST/vllm-eval.txt"
