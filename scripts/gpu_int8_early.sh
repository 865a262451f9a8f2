#!/usr/bin/env bash
# One GPU, a few minutes (e.g. gpu_tp.sh's DURING_COMPILE): the W8A16 Gluon kernel (REGS) with
# EARLY 2 (the first two K-blocks' weights loaded before the PDL wait) against the table's row,
# at 4096 x 4096 (the one issue-4 shape under 1.7x), after its correctness check.
set -uo pipefail
python3 scripts/check_int8_regs_gpu.py 2>&1 | tail -4
row='"REGS": true, "BLOCK_M": 8, "BLOCK_N": 16, "PREFETCH": false'
python3 scripts/bench_int8.py --decode-m 8,4 --no-prefill --shapes 4096x4096 --configs \
  "{$row, \"BLOCK_K\": 128, \"SPLIT_K\": 4, \"WARPS_K\": 4, \"num_warps\": 4}" \
  "{$row, \"BLOCK_K\": 128, \"SPLIT_K\": 4, \"WARPS_K\": 4, \"num_warps\": 4, \"EARLY\": 1}" \
  "{$row, \"BLOCK_K\": 128, \"SPLIT_K\": 4, \"WARPS_K\": 4, \"num_warps\": 4, \"EARLY\": 2}" \
  "{$row, \"BLOCK_K\": 256, \"SPLIT_K\": 1, \"WARPS_K\": 8, \"num_warps\": 8, \"EARLY\": 2}" \
  "{$row, \"BLOCK_K\": 128, \"SPLIT_K\": 2, \"WARPS_K\": 8, \"num_warps\": 8, \"EARLY\": 2}" \
  "{$row, \"BLOCK_K\": 128, \"SPLIT_K\": 1, \"WARPS_K\": 16, \"num_warps\": 16, \"EARLY\": 2}" \
  "{$row, \"BLOCK_K\": 128, \"SPLIT_K\": 4, \"WARPS_K\": 4, \"num_warps\": 4}"
