#!/usr/bin/env bash
# Tensor parallel on several GPUs (issue 8): correctness vs tp=1 and scaling, one call.
#   bash scripts/gpu_tp.sh [SHAPE] [DTYPE]      (on a machine with 4 GPUs; writes under $OUT)
# Compiles a random-weight model for tp=1,2,4 (and int8 tp=1,4), checks that greedy tokens of
# every tp equal tp=1 (torchrun + NCCL, CUDA graphs with the all-reduces captured), then runs
# `dsc bench` per tp: batch-1 ms/token, batch-64 tokens/s, per-rank memory.
set -euo pipefail
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
    make_random_checkpoint(p, "$SHAPE", dtype="$DTYPE", device="cuda", tokenizer=False)
PY
TPS="1 2 4"; [ "$NGPU" -lt 4 ] && TPS="1 2"
PROMPTS='--token-ids 1,2,3,4,5,6,7,8,9,10,11 --token-ids 20,21,22 --token-ids 30,31,32,33,34,35,36'
for INT8 in "" "--int8"; do
  for TP in $TPS; do
    [ -n "$INT8" ] && [ "$TP" = 2 ] && continue
    A="$W/art-tp$TP${INT8:+-int8}"
    [ -f "$A/manifest.json" ] || python3 -m dsc compile "$W/ckpt" -o "$A" --tp "$TP" $INT8 --max-batch 64 --max-seq 1024 2>&1 | tail -1
    python3 -m dsc generate "$A" $PROMPTS --max-new-tokens 24 --no-verify > "$OUT/tokens-tp$TP${INT8:+-int8}.jsonl"
    if [ "$TP" != 1 ]; then
      if cmp -s "$OUT/tokens-tp1${INT8:+-int8}.jsonl" "$OUT/tokens-tp$TP${INT8:+-int8}.jsonl"; then
        echo "tp=$TP${INT8:+ int8}: greedy tokens == tp=1"
      else
        echo "tp=$TP${INT8:+ int8}: greedy tokens DIFFER from tp=1"; diff "$OUT/tokens-tp1${INT8:+-int8}.jsonl" "$OUT/tokens-tp$TP${INT8:+-int8}.jsonl" || true
      fi
    fi
    python3 -m dsc bench "$A" --batch 1 --batch 64 --prefill 128 --iters 30 --json "$OUT/bench-tp$TP${INT8:+-int8}.json"
  done
done
python3 - <<PY
import json, glob, os
rows = {}
for f in sorted(glob.glob("$OUT/bench-tp*.json")):
    r = json.load(open(f)); tag = os.path.basename(f)[6:-5]
    rows[tag] = r
print(f"{'artifact':>12} {'b1 ms/tok':>10} {'vs tp1':>7} {'b64 tok/s':>10} {'vs tp1':>7}")
for tag, r in rows.items():
    base = rows.get("tp1-int8" if "int8" in tag else "tp1")
    d1, d64 = r["decode"].get("1"), r["decode"].get("64")
    b1, b64 = base["decode"].get("1"), base["decode"].get("64")
    print(f"{tag:>12} {d1['ms_per_step']:>10.3f} {d1['ms_per_step'] / b1['ms_per_step']:>6.2f}x "
          f"{d64['tokens_per_s'] if d64 else 0:>10.0f} {(d64['tokens_per_s'] / b64['tokens_per_s']) if d64 and b64 else 0:>6.2f}x")
PY
