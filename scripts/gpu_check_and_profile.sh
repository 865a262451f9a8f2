#!/usr/bin/env bash
# One GPU call after a kernel change: the attention kernels and every fused kernel against their
# references at real shapes (CUDA-graph replay included), the GEMV inside tiny models
# (gpu_smoke), then `bench --profile` at batch 1 for the 1B, GPT-2-XL, 8B and 8B-int8 shapes.
# Results are packed into $OUT/results.tgz (the tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-.}
R=$OUT/r
mkdir -p "$R"
OUT="$R" python3 scripts/check_attention_gpu.py 2>&1 | grep -v -i warn | tee "$R/check_attention_gpu.txt" | grep -E "FAIL|checks passed"
OUT="$R" python3 scripts/check_kernels_gpu.py 2>&1 | grep -v -i warn | tee "$R/check_kernels_gpu.txt" | grep -E "FAIL|passed"
python3 scripts/gpu_smoke.py 2>&1 | grep -v -i warn | tee "$R/gpu_smoke.txt" | grep -E "gemv|FAIL"
OUT="$R" SHAPES=${SHAPES:-"llama-1b:bfloat16 gpt2-xl:float16 llama-8b:bfloat16 llama-8b:bfloat16:int8"} \
  bash scripts/gpu_profile.sh 2>&1 | grep -E "^\s+[0-9.]+\s+[0-9.]+%|step|^\s+1\s|load|==" | head -150
tar czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
