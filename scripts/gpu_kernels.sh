#!/usr/bin/env bash
# One GPU, issues 4 and 5 in one call: every kernel checked at real shapes, then measured.
#   bash scripts/gpu_kernels.sh checks   # check_kernels_gpu, check_attention_gpu, bench_kernels,
#                                        # bench_attention --sweep             (about 3 minutes)
#   bash scripts/gpu_kernels.sh int8     # bench_int8: M=1 and M=8 sweep of every W8A16 variant
#                                        # (M=8 only: INT8_M=8), then all shapes with the defaults
#   bash scripts/gpu_kernels.sh fusions  # the decode fusions at real shapes (check_fused_decode_gpu),
#                                        # check_attention_gpu, the CUDA-graph prefill against eager
#                                        # (gpu_check_prefill_graphs), the runtime on GPU vs CPU
#                                        # (gpu_check_runtime, bf16 Llama-1B shape)
#   bash scripts/gpu_kernels.sh regs     # the Gluon W8A16 kernel (REGS configs): its GPU check
#                                        # (check_int8_regs_gpu), then its M=8 sweep (INT8_M=...)
#   bash scripts/gpu_kernels.sh int8-check   # int8 end to end: check_int8_regs_gpu, the runtime at
#                                        # Llama-8B dims (2 layers, int8) with 6 prompts, bench_int8 --quick
#   bash scripts/gpu_kernels.sh int8-batch   # bench_int8 at M=32 and 64 (the batch-64 decode
#                                        # path, slower than bf16 in session 5)
#   bash scripts/gpu_kernels.sh short    # batch-1 decode attention configs at 128-4096 keys
#                                        # (bench_attention --short; dsc bench decodes at 128)
# Each step has its own timeout so that one slow step cannot take the others' results; logs
# and JSON go to $OUT (packed into $OUT/results.tgz).
set -uo pipefail
OUT=${OUT:-/tmp/dsc-kernels}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1
pack() { tar czf "$OUT/results.tgz" -C "$R" . ; }
step() {  # step NAME TIMEOUT CMD...: runs CMD with OUT=$R, logs to $R/NAME.log
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  OUT=$R timeout "$t" "$@" > "$R/$name.log" 2>&1
  echo "== $name: rc=$? $((SECONDS - t0)) s"
  grep -v -i "warn" "$R/$name.log" | tail -${TAIL:-25}
  pack
}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
case "${1:-checks}" in
  checks)
    step check_kernels 100 python3 scripts/check_kernels_gpu.py
    step check_attention 180 python3 scripts/check_attention_gpu.py
    TAIL=14 step bench_kernels 80 python3 scripts/bench_kernels.py
    TAIL=40 step bench_attention 265 python3 scripts/bench_attention.py --sweep
    ;;
  int8)
    TAIL=20 step bench_int8_sweep 440 python3 scripts/bench_int8.py --decode-m "${INT8_M:-1,8}" --no-prefill
    mv "$R/bench_int8.json" "$R/bench_int8_sweep.json" 2>/dev/null
    mv "$R/tuning_int8.json" "$R/tuning_int8_sweep.json" 2>/dev/null
    TAIL=14 step bench_int8_quick 120 python3 scripts/bench_int8.py --quick
    ;;
  fusions)
    TAIL=8 step check_fused_decode 150 python3 scripts/check_fused_decode_gpu.py
    TAIL=6 step check_attention 180 python3 scripts/check_attention_gpu.py
    TAIL=6 step check_prefill_graphs 200 python3 scripts/gpu_check_prefill_graphs.py
    TAIL=12 step check_runtime 240 python3 scripts/gpu_check_runtime.py --shape llama-1b --dtype bfloat16
    ;;
  regs)
    TAIL=12 step check_int8_regs 200 python3 scripts/check_int8_regs_gpu.py
    TAIL=12 step bench_int8_regs 400 python3 scripts/bench_int8.py --decode-m "${INT8_M:-8}" --no-prefill --regs
    mv "$R/bench_int8.json" "$R/bench_int8_regs.json" 2>/dev/null
    mv "$R/tuning_int8.json" "$R/tuning_int8_regs.json" 2>/dev/null
    ;;
  int8-check)  # the int8 paths end to end: the Gluon kernel's check (its through-op cases run
               # every table row), the runtime at Llama-8B's dims in int8 with 6 prompts (the
               # 8-row decode bucket: the table's rows of both W8A16 kernels), the bench's defaults
    TAIL=6 step check_int8_regs 200 python3 scripts/check_int8_regs_gpu.py
    TAIL=8 step check_runtime_8b_int8 240 python3 scripts/gpu_check_runtime.py --shape llama-8b --layers 2 --batch 6 \
      --dtype bfloat16 --int8
    TAIL=14 step bench_int8_quick 120 python3 scripts/bench_int8.py --quick --no-prefill
    mv "$R/bench_int8.json" "$R/bench_int8_quick.json" 2>/dev/null
    # the default (regs_default) at the Llama-8B / -1B layer shapes without a table row
    TAIL=40 step bench_int8_defaults 200 python3 scripts/bench_int8.py --quick --no-prefill --decode-m 2,8 \
      --shapes 4096x6144,4096x3072,4096x1536,4096x28672,4096x7168,1024x4096,3584x4096,2048x4096,7168x4096,2048x3072,2048x2048,2048x16384,8192x2048
    ;;
  int8-batch)
    TAIL=12 step bench_int8_batch 420 python3 scripts/bench_int8.py --decode-m 32,64 --no-prefill
    ;;
  short)
    TAIL=70 step bench_attention_short 200 python3 scripts/bench_attention.py --short
    ;;
esac
