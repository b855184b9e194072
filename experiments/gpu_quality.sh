#!/usr/bin/env bash
# The GPU quality run (docs/results/gpu-runs.md, "The GPU quality run") on a CUDA machine that has torch and
# transformers, with or without network, sized for about 15 minutes of GPU time: on-policy replies to ShareGPT first
# turns (records below 17,000) generated with HF for a fixed time, the ShareGPT replies of the first OFF_RECORDS records
# extracted beside them as off-policy data, a draft trained for a fixed time, and the export copied back to be measured
# in vLLM on another machine. Every stage is bounded by the clock, not by a size, because the GPU's speed is not known
# in advance: a stopped `generate` keeps its committed chunks and a stopped `train` its checkpoint.
#
# On a machine with network:  bash experiments/gpu_quality.sh assets   -> .whl/ and .whl-speculators/ (wheel folders)
#                                                              and .gpu/ (prompts, eval sets, the GGUF xz-packed in
#                                                              parts of at most PART_MIB); copy the repository with
#                                                              them to the GPU machine (an air-gapped one installs
#                                                              from .whl/ alone)
# On the GPU machine, in the repository root (each verb returns; the pipeline runs in its own session between calls):
#   bash experiments/gpu_quality.sh stage-a       copies .gpu/ and the wheels to $WORK and installs them
#   bash experiments/gpu_quality.sh gen-bench     instead of `go`: the HF generate benchmark
#                                             (python -m bench.bench_generate --backend hf --device cuda) into $OUT
#   bash experiments/gpu_quality.sh go SECONDS    first call: starts the pipeline (log: $WORK/log); every call: waits
#                                             until it ends or SECONDS pass and reports; once it has ended, puts the
#                                             export into $OUT (model.safetensors in parts of at most PART_MIB,
#                                             config.json, sha256) with the logs: the folder to copy back
#   bash experiments/gpu_quality.sh pack-gguf GGUF | unpack-gguf    the GGUF's parts alone (assets and stage-a use them)
# Sizes and times come from the environment (defaults below). VARIANTS trains further drafts beside the main one, on
# the same caches and clock (an ablation at equal time), e.g. VARIANTS="l4k8=--draft-layers 4 --depths 8;lr1e-3=--lr 1e-3":
# each name's flags override the main run's. Beside training, the target's greedy replies to EVAL_SETS (MT-Bench first
# turns, HumanEval) are generated and extracted on the GPU machine, and every draft is walked over them as vLLM serving
# min(4, its K) tokens walks a reply (experiments/draft_on_cache.py, `acceptance_walk`: on the target's greedy
# replies, the AL vLLM measures); the walks come back in logs.txt and in go's output.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/gq}
OUT=${OUT:-$WORK/out}  # the results to copy back from the GPU machine
PART_MIB=${PART_MIB:-15}  # the largest file written for copying (the GGUF's and the export's parts)
PY=${PYTHON:-python3}
RANKS=${RANKS:-4}
TURNS=${TURNS:-first}  # all: multi-turn, several generate calls per conversation (HF generate is the slow stage)
TEMPERATURE=${TEMPERATURE:-0.7}
MAX_NEW=${MAX_NEW:-256}
GEN_RANKS=${GEN_RANKS:-1}  # generate processes: one per GPU (ranks sharing a GPU compete for it)
GEN_BATCH=${GEN_BATCH:-}  # replies decoded together; empty: as many as the free GPU memory holds
GEN_CHUNK=${GEN_CHUNK:-8192}  # conversations per committed chunk (several batches: finished rows are refilled)
GEN_SECONDS=${GEN_SECONDS:-220}  # generation stops this long after the pipeline started
TRAIN_END=${TRAIN_END:-480}  # training stops (with a checkpoint) this long after the pipeline started
OFF_RECORDS=${OFF_RECORDS:-3000}  # ShareGPT records whose own replies are extracted as off-policy data (0: none)
OFF_RANKS=${OFF_RANKS:-1}  # off-policy extraction ranks (beside the generation ranks on the same GPU)
EPOCHS=${EPOCHS:-4}
TOKENS_PER_STEP=${TOKENS_PER_STEP:-16384}
LR=${LR:-2e-3}
DRAFT_LAYERS=${DRAFT_LAYERS:-1}  # 1 / 2 / 4 (the paper: 4 layers +26 % AL at its data scale)
DEPTHS=${DEPTHS:-4}  # trained K; the export serves min(4, DEPTHS) (`export --speculative-tokens`); the paper trains at 8
DRAFT_VOCAB=${DRAFT_VOCAB:-16384}
LOSS_POSITIONS=${LOSS_POSITIONS:-all}  # all: prompt tokens carry loss too (+0.04 AL on the CPU quality run, docs/results/quality.md)
VARIANTS=${VARIANTS:-}  # NAME=FLAGS;NAME=FLAGS: more drafts trained beside the main one (their flags override its)
EVAL_SETS=${EVAL_SETS-mtbench humaneval}  # greedy replies walked by every draft (empty: none)
EVAL_NEW=${EVAL_NEW:-64}  # new tokens per greedy reply (make quality's and the last GPU run's vLLM setting)
DEVICE=${DEVICE:-cuda}
MAX_SAMPLES=${MAX_SAMPLES:-17000}  # smaller (and OFF_SAMPLES) for a rehearsal of this script on a CPU (DEVICE=cpu)
OFF_SAMPLES=${OFF_SAMPLES:-}  # off-policy records extracted (empty: all OFF_RECORDS that were packed)
MODEL=$WORK/models/SmolLM2-135M-Instruct
CLI=("$PY" -m peagle_pipeline.cli)
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false

say() { echo "[gpu-quality $(date +%H:%M:%S)] $*"; }
stamp() { echo "$1 $(date +%s)" >>"$WORK/times.txt"; }

assets() {  # with network: wheels, the training prompts (records < 17,000), the eval sets and the packed GGUF
  scripts/gpu_wheels.sh --speculators  # .whl (zarr stack, gguf, ours) and .whl-speculators (the profile's comparator)
  mkdir -p .gpu
  "$PY" scripts/prepare_demo.py --out .demo --skip-model
  "$PY" - <<'PYEOF'
# The conversations of ShareGPT records 0..16999 (held out: 17,000 on): every reply is regenerated, so the original
# replies are replaced by a stub, human turns are cut at 8,000 characters (a longer prompt exceeds the 1,024-token
# prompt limit, which skips it either way) and conversations at 6 human turns (later ones exceed it too).
import json
with open(".demo/data/sharegpt.jsonl") as src, open(".gpu/prompts.jsonl", "w") as out:
    for i, line in enumerate(src):
        if i >= 17_000:
            break
        record, conv, humans = json.loads(line), [], 0
        for turn in record.get("conversations", []):
            turn = dict(turn)
            if turn.get("from") == "human":
                humans += 1
                if humans > 6:
                    break
                turn["value"] = turn["value"][:8000]
            elif turn.get("from") == "gpt":
                turn["value"] = "(regenerated by the target)"
            conv.append(turn)
        out.write(json.dumps({"id": record.get("id"), "conversations": conv}, ensure_ascii=False) + "\n")
PYEOF
  xz -T2 -9 -f .gpu/prompts.jsonl
  "$PY" - <<'PYEOF'
# The prompts vLLM's AL is measured on afterwards (evaluate --prompts mt-bench / humaneval), as one-turn chats for
# `generate --turns first` on the GPU machine: the greedy replies every draft is walked over.
import json
from peagle_pipeline.stages.evaluate import prompts as p
for name, chats in (("mtbench", p.mt_bench_questions(p.mt_bench_file())),
                    ("humaneval", p.humaneval_questions(p.humaneval_file()))):
    with open(f".gpu/{name}.jsonl", "w") as out:
        for messages in chats:
            stub = {"role": "assistant", "content": "(regenerated by the target)"}
            out.write(json.dumps({"messages": [*messages, stub]}, ensure_ascii=False) + "\n")
PYEOF
  rm -f .gpu/offpolicy.jsonl.xz
  if ((OFF_RECORDS > 0)); then head -n "$OFF_RECORDS" .demo/data/sharegpt.jsonl | xz -T2 -9 >.gpu/offpolicy.jsonl.xz; fi
  pack_gguf "$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); from prepare_demo import find_gguf; print(find_gguf())")" || exit 1
  du -sh .whl .whl-speculators .gpu
}

pack_gguf() {  # the GGUF xz-compressed (8 % smaller) into .gpu/gguf.xz.part000.. of at most PART_MIB each, and its sha256
  local gguf=$1 size
  [[ -f $gguf ]] || { say "error: pack-gguf needs the GGUF file ($gguf)"; return 2; }
  mkdir -p .gpu && rm -f .gpu/gguf.*
  xz -9 -T2 -c "$gguf" | split -b $((PART_MIB << 20)) -d -a 3 - .gpu/gguf.xz.part &&
    sha256sum "$gguf" | cut -d' ' -f1 >.gpu/gguf.sha256 || return 1
  size=$(cat .gpu/gguf.xz.part* | wc -c)
  say "GGUF: $(($(stat -c %s "$gguf") >> 10)) KiB, packed $((size >> 10)) KiB in $(ls .gpu/gguf.xz.part* | wc -l) part(s)"
}

unpack_gguf() {  # $WORK/model.gguf from its parts, checked against the checksum taken when it was packed
  cat "$WORK"/gguf.xz.part* | xz -dc >"$WORK/model.gguf" &&
    [[ $(sha256sum "$WORK/model.gguf" | cut -d' ' -f1) == $(cat "$WORK/gguf.sha256") ]] || { say "GGUF damaged"; exit 1; }
}

target_model() {  # the target as a transformers model directory ($MODEL) from the copied GGUF
  unpack_gguf
  "$PY" scripts/prepare_demo.py --out "$WORK" --skip-data --gguf "$WORK/model.gguf" || exit 1
}

stage_a() {
  mkdir -p "$WORK/whl" && find .gpu -maxdepth 1 -type f -exec cp -t "$WORK/" {} + && cp .whl/*.whl "$WORK/whl/" && say "staged: $(ls "$WORK" | tr '\n' ' ')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  if [[ -z ${SKIP_INSTALL:-} ]]; then
    # gguf without its requirements: requests serves only its downloader, and the machine may lack it (numpy,
    # pyyaml and tqdm, what its reader uses, come with transformers).
    "$PY" -m pip install -q --no-index --find-links "$WORK/whl" --no-compile "$WORK"/whl/peagle_pipeline-*.whl &&
      "$PY" -m pip install -q --no-index --no-deps --no-compile "$WORK"/whl/gguf-*.whl &&
      say "installed" || exit 1
  fi
}

pipeline() {  # the whole run, in order, each stage bounded in time; each stage logs to $WORK/<stage>*.log
  cd "$OLDPWD_REPO" || exit 1
  local t0 pid n
  t0=$(date +%s)
  trap 'kill -TERM $(jobs -p) 2>/dev/null' EXIT  # a failed stage leaves no rank running behind it
  stamp start
  say "model"
  target_model
  xz -dkf "$WORK/prompts.jsonl.xz"
  [[ -f $WORK/offpolicy.jsonl.xz ]] && xz -dkf "$WORK/offpolicy.jsonl.xz"
  stamp prepared
  # Off-policy extraction (the ShareGPT replies as written) beside the generation: the GPU has room for both.
  OFF_PIDS=()
  if [[ -f $WORK/offpolicy.jsonl ]]; then
    for ((r = 0; r < OFF_RANKS; r++)); do
      "${CLI[@]}" extract --model "$MODEL" --data "$WORK/offpolicy.jsonl" --output "$WORK/cache-off" --backend hf \
        --device "$DEVICE" --topk 32 --max-length 1536 --batch-tokens 32768 --dtype bf16 --rank $r \
        --world-size "$OFF_RANKS" ${OFF_SAMPLES:+--max-samples "$OFF_SAMPLES"} >"$WORK/extract-off-$r.log" 2>&1 &
      OFF_PIDS+=($!)
    done
  fi
  say "generate: $GEN_RANKS ranks, turns $TURNS, T $TEMPERATURE, <= $MAX_NEW new tokens, for at most ${GEN_SECONDS}s"
  PIDS=()
  for ((r = 0; r < GEN_RANKS; r++)); do
    "${CLI[@]}" generate --model "$MODEL" --data "$WORK/prompts.jsonl" --output "$WORK/onpolicy" --backend hf \
      --device "$DEVICE" --max-samples "$MAX_SAMPLES" --turns "$TURNS" --temperature "$TEMPERATURE" --top-p 0.95 --max-new-tokens "$MAX_NEW" \
      --max-prompt-tokens 1024 --chunk-size "$GEN_CHUNK" ${GEN_BATCH:+--batch-size "$GEN_BATCH"} --rank $r --world-size "$GEN_RANKS" \
      >"$WORK/generate-$r.log" 2>&1 &
    PIDS+=($!)
  done
  until_done_or $((t0 + GEN_SECONDS)) "${PIDS[@]}"
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done  # a stopped rank keeps its committed chunks
  for pid in "${PIDS[@]}"; do wait "$pid"; done
  n=$(committed_rows "$WORK/onpolicy" "$WORK/onpolicy.jsonl") || { say "generate failed: no rows"; exit 1; }
  stamp generated
  say "generated: $n conversations committed"
  say "extract: $RANKS ranks"
  PIDS=()
  for ((r = 0; r < RANKS; r++)); do
    "${CLI[@]}" extract --model "$MODEL" --data "$WORK/onpolicy.jsonl" --output "$WORK/cache" --backend hf --device "$DEVICE" \
      --topk 32 --max-length 1536 --batch-tokens 32768 --dtype bf16 --rank $r --world-size "$RANKS" \
      >"$WORK/extract-$r.log" 2>&1 &
    PIDS+=($!)
  done
  wait_ranks extract || exit 1
  stamp extracted
  EXTRA=()
  if ((${#OFF_PIDS[@]})); then  # the off-policy cache joins training only if every rank finished in time
    until_done_or $((t0 + GEN_SECONDS + 60)) "${OFF_PIDS[@]}"
    for pid in "${OFF_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    local off_failed=0
    for pid in "${OFF_PIDS[@]}"; do wait "$pid" || off_failed=1; done
    if ((off_failed == 0)); then EXTRA=(--extra-cache "$WORK/cache-off") && say "off-policy cache joins training"; fi
  fi
  local names=(main) flags=("") v workers
  IFS=';' read -ra VS <<<"$VARIANTS"
  for v in "${VS[@]}"; do [[ -n ${v// /} ]] && names+=("${v%%=*}") && flags+=("${v#*=}"); done
  workers=$((8 / ${#names[@]} > 2 ? 8 / ${#names[@]} : 2))
  say "train: ${names[*]}: $EPOCHS epochs of $TOKENS_PER_STEP-token steps, stopped at ${TRAIN_END}s"
  PIDS=()
  for ((i = 0; i < ${#names[@]}; i++)); do
    # shellcheck disable=SC2086  # a variant's flags are words
    "${CLI[@]}" train --cache "$WORK/cache" "${EXTRA[@]}" --output "$(run_dir "${names[i]}")" --device "$DEVICE" --draft-layers "$DRAFT_LAYERS" --depths "$DEPTHS" \
      --draft-vocab-size "$DRAFT_VOCAB" --tokens-per-step "$TOKENS_PER_STEP" --epochs "$EPOCHS" --lr "$LR" \
      --loss-positions "$LOSS_POSITIONS" --warmup 50 --schedule cosine --eval-samples 256 --eval-every 100 --save-every 100 --log-every 10 \
      --num-workers "$workers" ${flags[i]} >"$(train_log "${names[i]}")" 2>&1 &
    PIDS+=($!)
  done
  local train_pids=("${PIDS[@]}") eval_pid=""
  if [[ -n ${EVAL_SETS// /} ]]; then eval_replies >"$WORK/eval-sets.log" 2>&1 & eval_pid=$!; fi
  until_done_or $((t0 + TRAIN_END)) "${train_pids[@]}"
  for pid in "${train_pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done  # each stops after its step in flight, with a checkpoint (exit 143)
  for pid in "${train_pids[@]}"; do wait "$pid"; done
  for ((i = 0; i < ${#names[@]}; i++)); do
    local r
    r=$(run_dir "${names[i]}")
    # the last checkpoint, also where train finished and exported its best: the weights the walks measure
    "${CLI[@]}" export "$r" --output "$r/export" --checkpoint latest >>"$(train_log "${names[i]}")" 2>&1 ||
      { ((i == 0)) && say "train failed" && exit 1; say "variant ${names[i]}: no export (train-${names[i]}.log)"; }
  done
  stamp trained
  if [[ -n $eval_pid ]]; then
    # (no "failed" in this line: `ended` reads that word as the pipeline's end)
    wait "$eval_pid" && walks "${names[@]}" || say "no walks, the greedy replies did not come: $(tail -n 2 "$WORK/eval-sets.log" | tr '\n' ' ')"
    stamp walked
  fi
  say "done"
}

run_dir() { [[ $1 == main ]] && echo "$WORK/run" || echo "$WORK/run-$1"; }
train_log() { [[ $1 == main ]] && echo "$WORK/train.log" || echo "$WORK/train-$1.log"; }

eval_replies() {  # the target's greedy replies to each of EVAL_SETS, extracted (fp32 storage): what the drafts are walked over
  local s
  for s in $EVAL_SETS; do
    "${CLI[@]}" generate --model "$MODEL" --data "$WORK/$s.jsonl" --output "$WORK/greedy-$s" --backend hf --device "$DEVICE" \
      --turns first --temperature 0 --max-new-tokens "$EVAL_NEW" --max-prompt-tokens 4096 || return 1
    "${CLI[@]}" extract --model "$MODEL" --data "$WORK/greedy-$s" --output "$WORK/cache-greedy-$s" --backend hf \
      --device "$DEVICE" --dtype fp32 --max-length 4096 || return 1
  done
}

walks() {  # walks NAME...: each draft over each set's greedy replies, as vLLM serving min(4, its K) tokens walks them
  local name s k r
  for name in "$@"; do
    r=$(run_dir "$name")
    [[ -d $r/checkpoints ]] || continue
    k=$(awk '$1 == "depths:" {print $2; exit}' "$r/train.yaml")
    k=$((k < 4 ? k : 4))
    for s in $EVAL_SETS; do
      echo "== $name on $s (K = $k, $EVAL_NEW new tokens, greedy)"
      timeout 300 "$PY" experiments/draft_on_cache.py "$r" "$WORK/cache-greedy-$s" --depths "$k" \
        --json "$WORK/walk-$name-$s.json" 2>&1 | tail -n 6
    done
  done | tee "$WORK/walks.txt"
}

until_done_or() {  # until_done_or END PID...: return when every PID has exited or the clock passes END
  local end=$1 pid alive
  shift
  while (($(date +%s) < end)); do
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 2
  done
}

committed_rows() {  # committed_rows GENERATE_DIR OUT.jsonl: the committed rows of every rank (finished or not)
  "$PY" - "$1" "$2" <<'PYEOF'
import json, pathlib, sys
root, n = pathlib.Path(sys.argv[1]), 0
with open(sys.argv[2], "wb") as out:
    for state_path in sorted(root.glob("state-rank*.json")):
        state = json.loads(state_path.read_text())
        rows = state_path.with_name(state_path.name.replace("state-", "rows-", 1)).with_suffix(".jsonl")
        with open(rows, "rb") as f:
            out.write(f.read(int(state.get("rows_bytes", 0))))
        n += int(state.get("rows", 0))
print(n)
sys.exit(0 if n else 1)
PYEOF
}

wait_ranks() {  # wait for the ranks in PIDS; fail if one failed
  local stage=$1 failed=0
  for pid in "${PIDS[@]}"; do wait "$pid" || failed=1; done
  [[ $failed == 0 ]] || { say "$stage failed: $(tail -n 2 "$WORK/$stage"-*.log | tr '\n' ' ')"; return 1; }
}

collect() {  # logs.txt always; with `all`, the run's metrics, settings and plot
  mkdir -p "$OUT"
  tail -n 40 "$WORK/log" "$WORK/times.txt" "$WORK"/generate-0.log "$WORK"/extract-0.log "$WORK"/extract-off-0.log \
    "$WORK"/train*.log "$WORK/eval-sets.log" 2>/dev/null | tr '\r' '\n' | tail -n 400 >"$OUT/logs.txt"
  [[ -f $WORK/walks.txt ]] && cat "$WORK/walks.txt" "$WORK"/walk-*.json >>"$OUT/logs.txt" 2>/dev/null
  if [[ ${1:-} == all ]]; then
    for f in metrics.jsonl train.yaml; do [[ -f $WORK/run/$f ]] && cp "$WORK/run/$f" "$OUT/"; done
    ls "$WORK/run/plots"/*.png >/dev/null 2>&1 && cp "$(ls "$WORK/run/plots"/*.png | head -1)" "$OUT/"
  fi
  true
}

go() {  # start once, wait, report, and once done put the export into $OUT
  local end=$(($(date +%s) + ${1:-500}))
  if [[ ! -f $WORK/log ]]; then
    OLDPWD_REPO=$PWD setsid nohup bash "$0" pipeline >"$WORK/log" 2>&1 </dev/null &
  fi
  while (($(date +%s) < end)) && ! ended; do sleep 5; done
  cat "$WORK/log" "$WORK/times.txt"
  for f in "$WORK"/generate-0.log "$WORK"/extract-0.log "$WORK"/extract-off-0.log "$WORK"/train*.log "$WORK/eval-sets.log"; do
    [[ -f $f ]] && { echo "== $f"; tail -c 1500 "$f" | tr '\r' '\n' | grep -v '^\s*$' | tail -n 6; }
  done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null; df -h "$WORK" | tail -1
  mkdir -p "$OUT"
  if grep -Eq '^\[gpu-quality [0-9:]+\] done' "$WORK/log"; then export_part; else collect; fi
}

ended() { grep -Eq '^\[gpu-quality [0-9:]+\] (done|.*failed|GGUF damaged)' "$WORK/log"; }

export_part() {  # the export into $OUT: model.safetensors in parts of at most PART_MIB, config.json, its sha256
  local exp=$WORK/run/export
  [[ -f $exp/model.safetensors ]] || { say "error: no export at $exp"; collect; return 1; }
  rm -f "$OUT"/model.safetensors.part*
  split -b $((PART_MIB << 20)) -d -a 3 "$exp/model.safetensors" "$OUT/model.safetensors.part" &&
    sha256sum "$exp/model.safetensors" >"$OUT/sha256" && cp "$exp/config.json" "$exp/.peagle-export.json" "$OUT/" || return 1
  collect all
  ls -la "$OUT"
}

gen_bench() {  # after stage-a: the HF generate stage vs plain model.generate (docs/guides/generate.md)
  [[ -f $MODEL/model.safetensors ]] || target_model
  [[ -f $WORK/prompts.jsonl ]] || xz -dkf "$WORK/prompts.jsonl.xz"
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  "$PY" -m bench.bench_generate --backend hf --device "$DEVICE" --model "$MODEL" --data "$WORK/prompts.jsonl" \
    --prompts "${BENCH_PROMPTS:-8192}" --max-new-tokens "$MAX_NEW" --max-prompt-tokens 1024 --temperature "$TEMPERATURE" \
    --plain-batch "${PLAIN_BATCH:-1024}" --plain-cache "${PLAIN_CACHE:-dynamic}" ${GEN_BATCH:+--batch-size "$GEN_BATCH"} \
    $([[ -z ${PLAIN_TWICE:-} ]] && echo --plain-once) $([[ -z ${SKIP_GRAPHS:-} && $DEVICE == cuda ]] && echo --cuda-graphs) --out "$OUT/generate-hf.json" >"$OUT/generate-hf.log" 2>&1
  local rc=$?
  tail -n 20 "$OUT/generate-hf.log"
  return $rc
}

case ${1:-} in
  assets) assets ;;
  pack-gguf) pack_gguf "${2:-}" ;;
  unpack-gguf) unpack_gguf ;;
  stage-a) stage_a ;;
  gen-bench) gen_bench ;;
  pipeline) OLDPWD_REPO=${OLDPWD_REPO:-$PWD} pipeline ;;
  go) go "${2:-500}" ;;
  *) echo "usage: $0 assets|pack-gguf GGUF|unpack-gguf|stage-a|go SECONDS|gen-bench"; exit 2 ;;
esac
