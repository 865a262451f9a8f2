#!/usr/bin/env bash
# Nsight Compute reads of the kernels still short of their targets (one GPU, ~3 minutes):
# the W8A16 kernels at 4096 x 4096 (issue 4: 8 tokens) and the prefill attention at 2048 tokens
# against cuDNN's (issue 5). One text report per run in $OUT; clocks left alone.
#   bash scripts/gpu_ncu.sh            # all
#   bash scripts/gpu_ncu.sh int8|attn  # one half
set -uo pipefail
OUT=${OUT:-/tmp/dsc-ncu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
NCU=(ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis
     --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy --section LaunchStats
     --section SchedulerStats --section ComputeWorkloadAnalysis)
prof() {  # prof NAME ARGS...: one ncu report, $OUT/ncu-NAME.txt
  local name=$1; shift
  local t0=$SECONDS
  timeout 120 "${NCU[@]}" python3 scripts/ncu_kernels.py "$@" > "$OUT/ncu-$name.txt" 2>&1
  echo "== $name: rc=$? $((SECONDS - t0)) s"
  grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Ipc|Compute \(SM\) Throughput|No Eligible" \
    "$OUT/ncu-$name.txt" | head -${TAIL:-14}
}
REGS='"kernel": "w8a16_mma", "REGS": true, "BLOCK_M": 8, "PREFETCH": false'
case "${1:-all}" in all|int8)
  prof int8-m8-table int8 --m 8
  prof int8-m4-table int8 --m 4
  prof int8-m1-gemv int8 --m 1
  prof int8-m8-wk8 int8 --m 8 --config "{$REGS, \"BLOCK_N\": 16, \"BLOCK_K\": 128, \"SPLIT_K\": 1, \"WARPS_K\": 8, \"num_warps\": 8}"
  prof int8-m8-bn64 int8 --m 8 --config "{$REGS, \"BLOCK_N\": 64, \"BLOCK_K\": 256, \"SPLIT_K\": 16, \"WARPS_K\": 1, \"num_warps\": 4}"
  ;; esac
case "${1:-all}" in all|attn)
  TAIL=30 prof prefill-b1 prefill --b 1 --s 2048
  TAIL=60 prof sdpa-cudnn-b1 sdpa --b 1 --s 2048
  ;; esac
