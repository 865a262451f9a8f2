#!/usr/bin/env bash
# One GPU call for the W8A16 GEMV at batch 1: tune its configs (scripts/tune_gemv.py --int8, Llama-8B
# shapes at tp 1/2/4 and Llama-1B), copy the merged table into kernels/tuning.json here, then
# `bench --profile` of the 8B --int8 artifact with it, then the 1B bf16 benchmark against
# transformers eager and static cache + torch.compile (issue 6's table). Packed into $OUT/results.tgz.
set -uo pipefail
OUT=${OUT:-.}
R=$OUT/r
mkdir -p "$R"
timeout 200 python3 scripts/tune_gemv.py --int8 --shapes llama-8b:bfloat16,llama-1b:bfloat16 --out "$R" 2>&1 \
  | grep -v -i warn | tee "$R/tune_gemv_int8.txt" | grep -v "^  skip"
[ -f "$R/tuning.json" ] && cp "$R/tuning.json" kernels/tuning.json && cp "$R/tuning.json" "$OUT/tuning.json"
OUT="$R" SHAPES="llama-8b:bfloat16:int8" bash scripts/gpu_profile.sh 2>&1 | grep -E "step|^\s+1\s|load|==|_kernel" | head -30
timeout 250 python3 scripts/bench_decode.py --shape llama-1b --dtype bfloat16 --hf eager,compile --hf-batches 1,64 \
  --out "$R" 2>&1 | grep -v -i warn | grep -v Loading | tee "$R/bench_llama-1b.txt" | tail -14
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
