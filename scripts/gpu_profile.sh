#!/usr/bin/env bash
# One-call decode profile on a GPU: for each shape below, a random-weight checkpoint, an artifact,
# and `bench --profile` at batch 1 (graph replay): time per kernel, time between kernels, and the
# bandwidth of every plan node. Explains the batch-1 gaps of issue 6 (no transformers baselines).
#   SHAPES="llama-1b:bfloat16 gpt2-xl:float16 llama-8b:bfloat16:int8" bash scripts/gpu_profile.sh
# Writes bench_<shape>-<dtype>.json (with a "profile" entry) and profile_<shape>.txt under $OUT.
set -uo pipefail
OUT=${OUT:-.}
SHAPES=${SHAPES:-"llama-1b:bfloat16 gpt2-xl:float16 llama-8b:bfloat16"}
for sd in $SHAPES; do
  IFS=: read -r shape dtype int8 <<< "$sd"
  timeout 300 python3 scripts/bench_decode.py --shape "$shape" --dtype "$dtype" --hf none --batches 1 \
      --prefill 128 --profile --out "$OUT" ${int8:+--int8} 2>&1 | grep -v -i warn \
      | tee "$OUT/profile_$shape${int8:+-int8}.txt" | tail -45
done
