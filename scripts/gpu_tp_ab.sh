#!/usr/bin/env bash
# A change to the tensor-parallel step, checked and measured in one call on a 4-GPU machine:
#   AB_ENVS="tp2,tp4:DSC_ALLGATHER=nccl" bash scripts/gpu_tp_ab.sh      (results under $OUT)
# 1. the Llama-8B (bf16) checkpoint and its tp=1/2/4 artifacts compile in the background
#    (scripts/gpu_tp.sh with nothing else to do) while
# 2. the fp32 Llama-1B compiles for tp=1/2/4 and generates: greedy tokens of tp=2 and tp=4 against
#    tp=1 (must be 72/72), tp=4 also under DSC_ALLREDUCE=nccl (every collective NCCL's);
# 3. then batch-1 benches of the 8B artifacts: the default and each AB_ENVS environment
#    (scripts/gpu_tp.sh's BENCH_ENVS, ENV_ROUNDS rounds), tp=1 in every round for the ratios.
# Results: $OUT/tokens-1b/results.tgz, $OUT/bench-8b/results.tgz (and the compile's $OUT/compile-8b).
set -uo pipefail
: "${AB_ENVS:?name the environments to bench against the default, as BENCH_ENVS in gpu_tp.sh}"
OUT=${OUT:-$(mktemp -d)}
W8=${W8:-$(mktemp -d /tmp/dsc-ab8.XXXXXX)}
W1=${W1:-$(mktemp -d /tmp/dsc-ab1.XXXXXX)}
T0=$SECONDS
(WORK=$W8 ARTS="tp1 tp2 tp4" NO_AR_CHECK=1 NO_GEN=1 NO_BENCH=1 OUT=$OUT/compile-8b bash scripts/gpu_tp.sh \
  > "$OUT/compile-8b.log" 2>&1; echo "8B checkpoint and compiles: rc=$? $((SECONDS - T0)) s") &
WORK=$W1 ARTS="tp1 tp2 tp4" NO_BENCH=1 NO_AR_CHECK=1 OUT=$OUT/tokens-1b bash scripts/gpu_tp.sh llama-1b float32 \
  > "$OUT/tokens-1b.log" 2>&1
echo "1B tokens: rc=$? $((SECONDS - T0)) s"
grep -E "tokens equal|unavailable|rc=" "$OUT/tokens-1b.log"
wait
WORK=$W8 ARTS="tp1 tp2 tp4" NO_AR_CHECK=1 NO_GEN=1 NO_BENCH=1 BENCH_ENVS="$AB_ENVS" OUT=$OUT/bench-8b \
  bash scripts/gpu_tp.sh > "$OUT/bench-8b.log" 2>&1
echo "8B benches: rc=$? $((SECONDS - T0)) s"
grep -E "^env |^ +artifact|^ +tp[0-9]" "$OUT/bench-8b.log"
