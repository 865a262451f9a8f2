#!/usr/bin/env bash
# One GPU call that re-checks what changed since the last GPU run and profiles the batch-1 gaps:
#   1. tiny Llama / GPT-2 / Mistral (sliding window) on CUDA, graphs and eager, vs the CPU runtime
#   2. the attention kernels at real shapes (windowed cases included) and every fused kernel
#      (add_layernorm x_bias, gelu bias included) against their references
#   3. `bench --profile` at batch 1 for the 1B, GPT-2-XL and 8B shapes (scripts/gpu_profile.sh)
# Everything lands under $OUT (logs, JSON). About 10 minutes on an H200, most of it step 3.
set -uo pipefail
OUT=${OUT:-.}
mkdir -p "$OUT"
python3 scripts/gpu_smoke.py 2>&1 | grep -v -i warn | tee "$OUT/gpu_smoke.txt" | tail -12
python3 scripts/check_attention_gpu.py 2>&1 | grep -v -i warn | tee "$OUT/check_attention_gpu.txt" | tail -8
python3 scripts/check_kernels_gpu.py 2>&1 | grep -v -i warn | tee "$OUT/check_kernels_gpu.txt" | tail -8
OUT="$OUT" bash scripts/gpu_profile.sh
