#!/usr/bin/env bash
# Build every dsc Triton kernel for sm_90 with another triton than the venv's, on a machine
# without a GPU. The GPU machines run triton 3.6 and CI 3.9, and a kernel can build in one and
# not the other (session 5: the fused all-reduce + norm compiled with 3.9 and failed with 3.6
# on the GPUs; this reproduces such failures in seconds, before a GPU call).
#   bash scripts/aot_other_triton.sh [VERSION]        (default 3.6.0; from the repository root,
#                                                      in the venv: . .venv/bin/activate)
# Uses the kernel test files' own sm_90 build modes (test_linear_kernel.py's: the GEMV and the GEMV
# + swiglu); prints one line per file and exits non-zero if any kernel failed to build (or a PDL
# variant touches memory before its griddepcontrol.wait, or a build spills registers where the
# file counts spills).
set -uo pipefail
V=${1:-3.6.0}
T=/tmp/dsc-triton-$V
[ -d "$T/triton" ] || python3 -m pip install -q --no-deps --target "$T" "triton==$V" || exit 1
export PYTHONPATH="$T${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
python3 -c "import triton; print('triton', triton.__version__, 'from', triton.__file__)" || exit 1
L=$(mktemp -d)
fail=0
for f in fused_kernels int8_kernels linear_kernel; do
  if python3 "tests/test_$f.py" aot "$L/$f.json" > "$L/$f.log" 2>&1; then
    python3 - "$L/$f.json" "$f" <<'PY' || fail=1
import json, sys
r = json.load(open(sys.argv[1]))
bad = sorted(k for k, v in r.items()  # pdl, spill_bytes: tests/kernel_child.py
             if not v.get("ok") or v.get("pdl", "ok") != "ok" or v.get("spill_bytes", 0))
print(f"{sys.argv[2]}: {len(r) - len(bad)}/{len(r)} built" + (f"; FAILED: {bad}" if bad else ""))
sys.exit(1 if bad else 0)
PY
  else
    echo "$f: FAILED ($(grep -m1 -i "error" "$L/$f.log"); log $L/$f.log)"; fail=1
  fi
done
python3 tests/test_attention_kernels.py compile-sm90 > "$L/attention.log" 2>&1
python3 - "$L/attention.log" <<'PY' || fail=1
import json, sys
lines = [ln for ln in open(sys.argv[1]) if ln.startswith("REPORT ")]
if not lines:
    print(f"attention_kernels: FAILED (no report; log {sys.argv[1]})"); sys.exit(1)
r = json.loads(lines[-1].removeprefix("REPORT "))
bad = sorted(k for k, v in r.items() if isinstance(v, str) and v != "ok")
print(f"attention_kernels: {len(r) - len(bad)}/{len(r)} built" + (f"; FAILED: {bad}" if bad else ""))
sys.exit(1 if bad else 0)
PY
python3 - <<'PY' || fail=1
from dsc.kernels import collectives as c
from dsc.kernels.launch import compile_for_arch
types = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "S": "*bf16", "Y": "*bf16", "BUFS": "*i64", "FLAGS": "*i64",
         "stride_x": "i32", "stride_r": "i32", "eps": "fp32", "rank": "i32", "flag_base": "i32"}
push = {k: v for k, v in types.items() if k not in ("FLAGS", "flag_base")} | {
    "region": "i32", "IDS": "*i64", "START": "*i64", "vocab": "i32"}
for world in (2, 4, 8):
    for pdl in (False, True):
        for rank1 in ({}, {"rank": 1}):  # triton turns an integer argument equal to 1 into a constant
            common = {"N": 4096, "WORLD": world, "BLOCK_W": world, "BLOCK_N": 4096, "PDL": pdl, **rank1}
            for embed in (False, True):  # EMBED: the vocab-parallel embedding + all-reduce + RMSNorm
                compile_for_arch(c._ar_push_add_rmsnorm_kernel, {k: v for k, v in push.items() if k not in rank1},
                                 {**common, "MARK": -32768, "EMBED": embed}, num_warps=8)
            compile_for_arch(c._ar_add_rmsnorm_kernel, {k: v for k, v in types.items() if k not in rank1},
                             common, num_warps=8)
gemv = {"X": "*bf16", "W": "*bf16", "BUFS": "*i64", "N": "i32", "K": "i32", "rank": "i32", "region": "i32"}
for world in (2, 4):
    for pdl in (False, True):
        for rank1 in ({}, {"rank": 1}):
            compile_for_arch(c._gemv_push_kernel, {k: v for k, v in gemv.items() if k not in rank1},
                             {"EVEN": True, "BLOCK_N": 2, "BLOCK_K": 128, "X_ROW": False, "WORLD": world,
                              "MARK": -32768, "PDL": pdl, **rank1}, num_warps=1)
f32 = {k: ("*fp32" if v == "*bf16" else v) for k, v in push.items()}  # fp32 models: 32-bit marker
compile_for_arch(c._ar_push_add_rmsnorm_kernel, f32,
                 {"N": 2048, "WORLD": 2, "BLOCK_W": 2, "BLOCK_N": 2048, "MARK": -2**31}, num_warps=8)
print("collectives: all_reduce_add_rmsnorm (pull and push, PDL on and off) built for 2, 4, 8 ranks, push also for fp32 "
      "and with the embedding (EMBED); GEMV push for 2, 4")
PY
exit $fail
