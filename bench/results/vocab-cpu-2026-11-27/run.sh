set -e
cd /work/main
Q=.quality/caches
for VD in 8192 16384 49152; do
  [ -f .scratch/vd/v$VD/export/model.safetensors ] && continue
  /usr/bin/time -f "train v$VD %e s" .venv/bin/python -m peagle_pipeline.cli train --cache $Q/on-multi \
    --extra-cache $Q/on-single --extra-cache $Q/on-greedy --extra-cache $Q/off-policy \
    --output .scratch/vd/v$VD --draft-vocab-size $VD --depths 4 --steps 450 --tokens-per-step 1024 --lr 0.002 \
    --warmup 10 --schedule cosine --down-sample-ratio 0.3 --down-sample-ratio-min 0.05 --loss-positions all \
    --eval-samples 32 --eval-every 150 --log-every 50 --num-workers 1 2>&1 | grep -v "^step" 
done
/usr/bin/time -f "evaluate %e s" .venv-vllm/bin/python -m peagle_pipeline.cli evaluate .scratch/vd/v8192/export .scratch/vd/v16384/export .scratch/vd/v49152/export \
  --target .demo/models/SmolLM2-135M-Instruct --prompts mt-bench --prompts .quality/data/heldout_prompts.jsonl --num-prompts 80 --max-tokens 64 \
  --temperature 0 --depths 4 --output .scratch/vd/eval --concurrency 16 --acceptance-concurrency 16
