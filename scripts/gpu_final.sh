#!/usr/bin/env bash
# One GPU call: `bench --profile` at batch 1 for the 1B, GPT-2-XL and 8B bf16 shapes with the
# committed tuning table, and for 1B and GPT-2-XL the same artifact again with DSC_GEMV=off
# (cuBLAS at every linear): the GEMV's end-to-end effect on the same card in the same run.
set -uo pipefail
OUT=${OUT:-.}
R=$OUT/r
mkdir -p "$R"
OUT="$R" SHAPES="llama-1b:bfloat16 gpt2-xl:float16" bash scripts/gpu_profile.sh 2>&1 | grep -E "step|^\s+1\s|==|_kernel" | head -40
for sd in llama-1b:bfloat16 gpt2-xl:float16; do
  DSC_GEMV=off timeout 120 python3 scripts/bench_decode.py --shape ${sd%%:*} --dtype ${sd##*:} --hf none --batches 1 \
    --prefill 128 --out "$R/cublas" 2>&1 | grep -v -i warn | tee "$R/cublas_${sd%%:*}.txt" | grep -E "^\s+1\s|=="
done
OUT="$R" SHAPES="llama-8b:bfloat16" bash scripts/gpu_profile.sh 2>&1 | grep -E "step|^\s+1\s|==|_kernel" | head -20
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
