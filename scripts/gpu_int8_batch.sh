#!/usr/bin/env bash
# One GPU, one call: the batch-64 --int8 decode path (slower than bf16 at batch 64 in sessions 5
# and 6). Sweeps the W8A16 tensor-core kernel at M = 64 (scripts/bench_int8.py --decode-m 64),
# then benches a random-weight Llama-8B at batch 1 and 64: bf16, --int8 with the committed
# kernels/tuning.json, and --int8 with the sweep's winners merged into this copy's table (the
# N = 14336, K = 4096 winner also for the qkv (N 6144) and gate_up (N 28672) shapes, which the
# sweep does not time). Results in $OUT/results.tgz; the merged rows in $OUT/r/tuning_merged.json.
set -uo pipefail
F=${OUT:-/tmp/dsc-int8b}; R=$F/r; W=${WORK:-/tmp/dsc-i8}
mkdir -p "$R" "$W"
export PYTHONUNBUFFERED=1
pack() { tar czf "$F/results.tgz" -C "$R" . ; }
T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
python3 - <<PY
from pathlib import Path
from dsc.compiler.random_checkpoint import make_random_checkpoint
if not (Path("$W/ckpt") / "config.json").exists():
    make_random_checkpoint(Path("$W/ckpt"), "llama-8b", dtype="bfloat16", device="cuda", tokenizer=False)
PY
echo "checkpoint: $((SECONDS - T0)) s"
for A in tp1 tp1-int8; do  # on the CPUs while the sweep uses the GPU
  INT8=""; [[ $A == *int8 ]] && INT8="--int8"
  [ -f "$W/$A/manifest.json" ] || (OMP_NUM_THREADS=8 python3 -m dsc compile "$W/ckpt" -o "$W/$A" $INT8 \
      --max-batch 64 --max-seq 1024 > "$R/compile-$A.log" 2>&1; echo "compiled $A: rc=$? $((SECONDS - T0)) s") &
done
OUT=$R timeout 330 python3 scripts/bench_int8.py --decode-m 64 --no-prefill > "$R/bench_int8_m64.log" 2>&1
echo "sweep: rc=$? $((SECONDS - T0)) s"; grep -v -i warn "$R/bench_int8_m64.log" | tail -8 | cut -c1-140
wait
pack
cp kernels/tuning.json "$R/tuning_committed.json"
python3 - "$R/tuning_int8.json" kernels/tuning.json "$R/tuning_merged.json" <<'PY'
import json, sys
won = json.load(open(sys.argv[1]))["sm_90"]
table = json.load(open(sys.argv[2]))
rows = {}
for kernel, classes in won.items():
    for cls, cfg in classes.items():
        if not cls.startswith("M64_"):
            continue
        rows.setdefault(kernel, {})[cls] = cfg
        if cls == "M64_N14336_K4096":
            for n in (6144, 28672):
                rows[kernel][f"M64_N{n}_K4096"] = cfg
for kernel, classes in rows.items():
    table["sm_90"].setdefault(kernel, {}).update(classes)
json.dump(rows, open(sys.argv[3], "w"), indent=1)
json.dump(table, open(sys.argv[2], "w"), indent=1)
print("merged:", json.dumps(rows))
PY
bench() {  # bench TAG ARTIFACT
  timeout 100 python3 -m dsc bench "$W/$2" --batch 1 --batch 64 --iters 30 --json "$R/bench-$1.json" > "$R/bench-$1.txt" 2>&1
  echo "$1: $(grep -E '^\s+(1|64)\s' "$R/bench-$1.txt" | awk '{printf "b%s %s ms  ", $1, $2}')"
}
bench int8-merged tp1-int8
cp "$R/tuning_committed.json" kernels/tuning.json
bench int8-committed tp1-int8
bench bf16 tp1
echo "done: $((SECONDS - T0)) s"
pack
