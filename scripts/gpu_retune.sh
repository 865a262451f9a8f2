#!/usr/bin/env bash
# One GPU call: retune both batch-1 GEMVs (16-bit vs cuBLAS, then W8A16) with the current candidate
# set, keep the merged table in kernels/tuning.json here, then `bench --profile` of the 1B bf16 and
# 8B --int8 shapes with it. Packed into $OUT/results.tgz; the table also as $OUT/tuning.json.
set -uo pipefail
OUT=${OUT:-.}
R=$OUT/r
mkdir -p "$R"
timeout 170 python3 scripts/tune_gemv.py --out "$R" 2>&1 | grep -v -i warn | tee "$R/tune_gemv.txt" | grep -E "tp1|rows"
[ -f "$R/tuning.json" ] && cp "$R/tuning.json" kernels/tuning.json
timeout 170 python3 scripts/tune_gemv.py --int8 --shapes llama-8b:bfloat16,llama-1b:bfloat16 --out "$R" 2>&1 \
  | grep -v -i warn | tee "$R/tune_gemv_int8.txt" | grep -E "tp1|shapes"
[ -f "$R/tuning.json" ] && cp "$R/tuning.json" kernels/tuning.json && cp "$R/tuning.json" "$OUT/tuning.json"
OUT="$R" SHAPES="llama-1b:bfloat16 llama-8b:bfloat16:int8" bash scripts/gpu_profile.sh 2>&1 \
  | grep -E "step|^\s+1\s|==|_kernel" | head -40
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
