#!/usr/bin/env bash
# Nsight Compute reads of the kernels still short of their targets (one GPU, ~3 minutes):
# the W8A16 kernels at 4096 x 4096 (issue 4: 8 tokens) and the prefill attention at 2048 tokens
# against cuDNN's (issue 5). One text report per run in $OUT; clocks left alone.
#   bash scripts/gpu_ncu.sh            # all
#   bash scripts/gpu_ncu.sh int8|attn  # one half
#   bash scripts/gpu_ncu.sh regs-n     # the Gluon kernel's 8-part form at N 3072 / 4096 / 6144
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
  grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Ipc|Compute \(SM\) Throughput|No Eligible|dram__|l1tex__|lts__" \
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
case "${1:-all}" in regs-n)  # one Gluon tiling (regs_default's 8-part form) at N 3072 / 4096 / 6144, K 4096
  NCU+=(--metrics dram__bytes_read.sum,l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read.sum)
  E8="{$REGS, \"BLOCK_N\": 16, \"BLOCK_K\": 256, \"SPLIT_K\": 1, \"WARPS_K\": 8, \"num_warps\": 8, \"EARLY\": true}"
  for n in 3072 4096 6144; do TAIL=40 prof "int8-m8-e8-n$n" int8 --m 8 --n "$n" --config "$E8"; done
  ;; esac
case "${1:-all}" in all|attn)
  TAIL=30 prof prefill-b1 prefill --b 1 --s 2048
  TAIL=60 prof sdpa-cudnn-b1 sdpa --b 1 --s 2048
  ;; esac
