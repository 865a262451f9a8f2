"""Run one dsc kernel a few times between cudaProfilerStart/Stop, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 scripts/ncu_kernels.py int8 --m 8 --k 4096 --n 4096 [--config '{"REGS": true, ...}']
    ncu ... python3 scripts/ncu_kernels.py prefill --b 1 --s 2048 [--config '{...}']
    ncu ... python3 scripts/ncu_kernels.py sdpa --b 1 --s 2048     # cuDNN's, the baseline

The warm-up calls (JIT compile, autotune-free) run before the profiler starts, so ncu sees
only the timed launches. The sections that read the int8 and attention bottlenecks:
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy --section LaunchStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis python3 scripts/ncu_kernels.py ...
    python3 scripts/ncu_kernels.py int8 --m 8 --smoke     # no profiler: the runner's code path
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8 import int8  # noqa: E402
from bench_kernels import HKV, A, D, H, prefill_inputs, sdpa_backend  # noqa: E402  (loads the kernels by path)

DTYPE = torch.bfloat16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["int8", "prefill", "sdpa"])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--s", type=int, default=2048)
    ap.add_argument("--config", default="", help="a JSON launch config (default: what the tables pick)")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="int8 on the CPU (TRITON_INTERPRET=1), no profiler")
    args = ap.parse_args()
    config = json.loads(args.config) if args.config else None
    dev = "cpu" if args.smoke else "cuda"
    if args.smoke and args.what != "int8":
        sys.exit("error: --smoke: only the int8 runner runs on the CPU")
    g = torch.Generator(device=dev).manual_seed(0)
    if args.what == "int8":
        w = torch.randn(args.n, args.k, generator=g, device=dev) / math.sqrt(args.k)
        p = int8.quantize_weight(w)
        x = torch.randn(args.m, args.k, generator=g, device=dev).to(torch.float16 if args.smoke else DTYPE)
        kernel = (config or {}).pop("kernel", None) if config else None

        def fn():
            return int8.w8a16_matmul(x, p["qweight"], p["scale"], None, None, args.k, kernel=kernel, config=config)
    elif args.what == "prefill":
        q, k, v, kc, vc, pos = prefill_inputs(args.b, args.s)

        def fn():
            return A.prefill_attention(q, k, v, kc, vc, pos, D**-0.5, config=config)
    else:
        q, k, v, _, _, _ = prefill_inputs(args.b, args.s)
        kx, vx = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)

        def fn():
            with sdpa_backend("CUDNN_ATTENTION"):
                return torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True, scale=D**-0.5)

    for _ in range(3):
        fn()
    if args.smoke:
        print(f"{args.what}: {fn().shape[-1]} outputs per row (smoke: nothing profiled)", file=sys.stderr)
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{args.what}: {args.calls} calls profiled", file=sys.stderr)


if __name__ == "__main__":
    main()
