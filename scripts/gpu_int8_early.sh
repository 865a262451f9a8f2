#!/usr/bin/env bash
# One GPU, ~6 minutes: the W8A16 Gluon kernel (REGS) with EARLY 2 (the first two K-blocks'
# weights loaded before the PDL wait) against each shape's current config (a tuning row or
# `regs_default`) and that config with EARLY 2, at Llama-8B's decode shapes, after the kernel
# check (scripts/check_int8_regs_gpu.py). Tuples: BLOCK_M BLOCK_N BLOCK_K SPLIT_K WARPS_K num_warps EARLY.
# Session 13's first run (4096 x 4096 only, 8 and 4 tokens: docs/results/s13-h200x4/tp-queued/
# during-compile.log) found the tile 16 x 256, 8 K parts, no split-K, EARLY 2 1.07x faster than
# the table's row at 8 tokens; it is that shape's row at 2-8 tokens since. Results of this
# version: docs/results/s13-h200/int8-early2/early2.log.
set -uo pipefail
python3 scripts/check_int8_regs_gpu.py 2>&1 | tail -3
cfg() { echo "{\"REGS\": true, \"PREFETCH\": false, \"BLOCK_M\": $1, \"BLOCK_N\": $2, \"BLOCK_K\": $3, \"SPLIT_K\": $4, \"WARPS_K\": $5, \"num_warps\": $6, \"EARLY\": $7}"; }
run() {  # run KxN M CFG...: the default first, then each CFG, printed one per line
  local shape=$1 m=$2; shift 2
  local cfgs=(); for c in "$@"; do cfgs+=("$(cfg $c)"); done
  python3 scripts/bench_int8.py --decode-m "$m" --no-prefill --shapes "$shape" --configs "${cfgs[@]}" 2>&1 \
    | grep -v "^CUDA-graph\|^op \|^wrote\|^W8A16 decode\|^NVIDIA"
}
# 4096 x 4096: the table's rows are this tile now (2-8 tokens); the old row; 16 tokens
run 4096x4096 2,8 "8 16 128 4 4 4 0" "8 16 256 1 8 8 2"
run 4096x4096 16 "16 16 256 1 8 8 0" "16 16 256 1 8 8 2" "16 16 128 2 8 8 2"
# 4096 x 14336 (row: 32 x 128, 4 K parts, EARLY 1)
run 4096x14336 8 "8 32 128 1 4 8 1" "8 32 128 1 4 8 2" "8 16 256 1 8 8 2" "8 16 256 2 4 4 2"
# 14336 x 4096 (row: the Triton mma kernel; regs_default: 16 x 128, 4 K parts, split-K 4)
run 14336x4096 8 "8 16 128 4 4 4 0" "8 16 128 4 4 4 2" "8 16 256 4 8 8 2" "8 16 256 2 8 8 2"
# regs_default's forms at Llama-8B's fused q/k/v (tp 1, 2) and gate/up (tp 1): EARLY 1 -> 2
run 4096x6144 8 "8 16 256 1 8 8 1" "8 16 256 1 8 8 2"
run 4096x3072 8 "8 16 256 1 8 8 1" "8 16 256 1 8 8 2"
run 4096x28672 8 "8 16 128 1 4 4 1" "8 16 128 1 4 4 2" "8 16 256 1 8 8 2"
# the table with the final rows (W8A8 prefill included), twice
python3 scripts/bench_int8.py --quick --decode-m 1,2,4,8,16 2>&1 | grep -v "^CUDA-graph\|^wrote"
python3 scripts/bench_int8.py --quick --decode-m 8 --no-prefill 2>&1 | grep -v "^CUDA-graph\|^wrote\|^NVIDIA"
