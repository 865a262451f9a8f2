#!/usr/bin/env bash
# Tensor parallel on several GPUs (issue 8): correctness vs tp=1 and scaling, in one call.
#   bash scripts/gpu_tp.sh [SHAPE] [DTYPE]      (on a machine with 4 GPUs; writes under $OUT)
# Compiles a random-weight model for tp=1,2,4 and int8 tp=1,4 (in parallel), checks that the
# greedy tokens of every tp equal tp=1 (torchrun + NCCL, decode steps replayed from CUDA graphs
# with the all-reduces captured), then runs `dsc bench` per artifact: batch-1 ms/token,
# batch-64 tokens/s, per-rank GPU memory.
set -uo pipefail
SHAPE=${1:-llama-8b}
DTYPE=${2:-bfloat16}
W=${WORK:-/tmp/dsc-tp}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU"
python3 - <<PY
from pathlib import Path
from dsc.compiler.random_checkpoint import make_random_checkpoint
p = Path("$W/ckpt")
if not (p / "config.json").exists():
    make_random_checkpoint(p, "$SHAPE", dtype="$DTYPE", device="${DEV:-cuda}", tokenizer=False)
PY
ARTS=${ARTS:-"tp1 tp2 tp4 tp1-int8 tp4-int8"}; [ "$NGPU" -lt 4 ] && ARTS="tp1 tp2 tp1-int8"
for A in $ARTS; do
  TP=${A#tp}; TP=${TP%-int8}; INT8=""; [[ $A == *int8 ]] && INT8="--int8"
  [ -f "$W/$A/manifest.json" ] || (python3 -m dsc compile "$W/ckpt" -o "$W/$A" --tp "$TP" $INT8 \
      --max-batch 64 --max-seq 1024 > "$OUT/compile-$A.log" 2>&1; echo "compiled $A: rc=$?") &
done
wait
PROMPTS='--token-ids 1,2,3,4,5,6,7,8,9,10,11 --token-ids 20,21,22 --token-ids 30,31,32,33,34,35,36'
for A in $ARTS; do
  timeout 120 python3 -m dsc generate "$W/$A" $PROMPTS --max-new-tokens 24 --no-verify > "$OUT/tokens-$A.jsonl" 2> "$OUT/generate-$A.log"
  BASE=tp1; [[ $A == *int8 ]] && BASE=tp1-int8
  if [ "$A" != "$BASE" ]; then
    if cmp -s "$OUT/tokens-$BASE.jsonl" "$OUT/tokens-$A.jsonl"; then echo "$A: greedy tokens == $BASE"
    else echo "$A: greedy tokens DIFFER from $BASE"; diff "$OUT/tokens-$BASE.jsonl" "$OUT/tokens-$A.jsonl" | head -6; tail -3 "$OUT/generate-$A.log"; fi
  fi
  [ -n "${NO_BENCH:-}" ] && continue
  timeout 150 python3 -m dsc bench "$W/$A" --batch 1 --batch 64 --prefill 128 --iters 30 --json "$OUT/bench-$A.json" 2>&1 | grep -v -i warn | tail -9
done
python3 - <<PY
import json, os
rows = {}
for a in "$ARTS".split():
    f = "$OUT/bench-" + a + ".json"
    if os.path.exists(f):
        rows[a] = json.load(open(f))
print(f"{'artifact':>10} {'b1 ms/tok':>10} {'vs tp1':>7} {'b64 tok/s':>10} {'vs tp1':>7}")
for tag, r in rows.items():
    base = rows.get("tp1-int8" if "int8" in tag else "tp1")
    d1, d64 = r["decode"].get("1"), r["decode"].get("64")
    b1, b64 = (base or {}).get("decode", {}).get("1"), (base or {}).get("decode", {}).get("64")
    print(f"{tag:>10} {d1['ms_per_step']:>10.3f} {d1['ms_per_step'] / b1['ms_per_step'] if b1 else 0:>6.2f}x "
          f"{d64['tokens_per_s'] if d64 else 0:>10.0f} {(d64['tokens_per_s'] / b64['tokens_per_s']) if d64 and b64 else 0:>6.2f}x")
PY
