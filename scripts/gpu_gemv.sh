#!/usr/bin/env bash
# One GPU call for the batch-1 GEMV (kernels/linear.py):
#   1. scripts/gpu_smoke.py: tiny models on CUDA vs CPU, and the GEMV forced at every decode
#      linear (DSC_GEMV=all) vs cuBLAS (tokens, decode logits)
#   2. scripts/tune_gemv.py: GEMV candidates vs cuBLAS at every linear shape of Llama-8B,
#      Llama-1B and GPT-2-XL at tp 1/2/4; the merged table is copied into kernels/tuning.json
#      here (so the artifacts compiled below plan with it) and returned as $OUT/tuning.json
#   3. scripts/gpu_profile.sh: bench --profile at batch 1 for the three shapes with that table
# Everything is packed into $OUT/gemv_results.tgz (the tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-.}
R=$OUT/r
mkdir -p "$R"
python3 scripts/gpu_smoke.py 2>&1 | grep -v -i warn | tee "$R/gpu_smoke.txt" | grep -E "gemv|FAIL"
python3 scripts/tune_gemv.py --out "$R" 2>&1 | grep -v -i warn | tee "$R/tune_gemv.txt"
[ -f "$R/tuning.json" ] && cp "$R/tuning.json" kernels/tuning.json && cp "$R/tuning.json" "$OUT/tuning.json"
OUT="$R" SHAPES=${SHAPES:-"llama-1b:bfloat16 gpt2-xl:float16 llama-8b:bfloat16"} bash scripts/gpu_profile.sh 2>&1 \
  | grep -E "^\s+[0-9.]+\s+[0-9.]+%|step|ms/step|^\s+1\s|load|GPU memory|==" | head -120
tar czf "$OUT/gemv_results.tgz" -C "$R" . && rm -rf "$R"
