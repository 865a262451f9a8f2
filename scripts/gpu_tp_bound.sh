#!/usr/bin/env bash
# One GPU: the tensor-parallel lower bound (scripts/tp_local_bound.py) at a model shape.
#   bash scripts/gpu_tp_bound.sh [SHAPE] [DTYPE]     (default llama-8b bfloat16; $OUT gets the logs)
# A random-weight checkpoint, compiled for tp 1, 2 and 4 in parallel on the CPUs, then rank 0 of
# each decoded on this one GPU with its collectives replaced by local stand-ins (no peer, no
# NVLink): the batch-1 step each tp would take if its all-reduces were free, against tp=1.
set -uo pipefail
SHAPE=${1:-llama-8b}
DTYPE=${2:-bfloat16}
W=${WORK:-/tmp/dsc-tpb}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1
T0=$SECONDS
python3 - <<PY
from pathlib import Path
from dsc.compiler.random_checkpoint import make_random_checkpoint
p = Path("$W/ckpt")
if not (p / "config.json").exists():
    make_random_checkpoint(p, "$SHAPE", dtype="$DTYPE", device="cuda", tokenizer=False)
PY
echo "checkpoint: $((SECONDS - T0)) s"
THREADS=$(( $(nproc) / 3 ))
for TP in ${TPS:-1 2 4}; do
  [ -f "$W/tp$TP/manifest.json" ] || (OMP_NUM_THREADS=$THREADS python3 -m dsc compile "$W/ckpt" -o "$W/tp$TP" --tp "$TP" \
      --max-batch 64 --max-seq 1024 > "$OUT/compile-tp$TP.log" 2>&1; echo "compiled tp$TP: rc=$? $((SECONDS - T0)) s") &
done
wait
ARTS=$(for TP in ${TPS:-1 2 4}; do echo -n "$W/tp$TP "; done)
OUT=$OUT timeout 300 python3 scripts/tp_local_bound.py $ARTS 2>&1 | grep -v -i warn | tee "$OUT/tp_local_bound.txt"
echo "done: $((SECONDS - T0)) s"
