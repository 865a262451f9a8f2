"""Benchmark `dsc::moe`'s Triton kernels (kernels/fused_moe.py) on one GPU, one MoE layer's experts.

    python scripts/bench_moe.py                       # Mixtral-8x7B and Qwen3-30B-A3B, T = 1, 16, 256, 4096
    python scripts/bench_moe.py --int8 --out r.json   # W8A16 weights too; every measurement as JSON
    TRITON_INTERPRET=1 python scripts/bench_moe.py --smoke   # no GPU: the script itself, tiny shapes

Per shape and token count T: `fused_moe_triton`, the eager reference (kernels/moe.py, one
F.linear pair per expert with tokens, as transformers' experts run) and a dense bf16 SwiGLU MLP
of intermediate size K * I (cuBLAS), which does the same FLOPs as the routed experts and, at
T = 1, reads the same weight bytes: the rough roofline. Reported: ms, the weight bytes the
kernels must read (the experts that received tokens) per second in TB/s, TFLOP/s of the routed
work (T * K * 6 * H * I), and the ratios reference / kernel and kernel / dense.
The routing is random (softmax router over normal logits), the same for every contender. Every
shape is checked against the reference first (max error <= 3e-2 of max |ref|). Timing: CUDA
events around each call, L2 flushed (a 256 MB write) before each, median over the repetitions
after warm-up; the kernel and the dense MLP replay CUDA graphs (what a decode step runs: no
Python launch overhead), the reference runs eagerly (it syncs on its routing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
from timing import checkout_modules

FM, MOE, Q = checkout_modules("kernels.fused_moe", "kernels.moe", "kernels.int8")

SHAPES = {  # name -> H, I, E, K
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
}
TOKENS = (1, 16, 256, 4096)
SMOKE_SHAPES = {"tiny-8x2": (40, 24, 8, 2), "tiny-16x4": (40, 24, 16, 4)}
SMOKE_TOKENS = (1, 9)


def flush_buffer(device):
    return torch.empty(256 << 20, dtype=torch.int8, device=device) if device.type == "cuda" else None


def time_ms(fn, flush, reps: int, warmup: int = 3) -> float:
    """Median ms of fn: CUDA events around each call after an L2 flush (CPU: perf_counter)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if flush is None:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn):
    """fn as a CUDA graph replay (warmed up on a side stream first); fn itself off CUDA."""
    if not torch.cuda.is_available():
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def layer(h, inter, e, k, int8, device, g):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    gu = (torch.randn(e * 2 * inter, h, generator=g, device=device) / math.sqrt(h)).to(dtype)
    dn = (torch.randn(e * h, inter, generator=g, device=device) / math.sqrt(inter)).to(dtype)
    if not int8:
        return gu, dn, None, None
    qg, qd = Q.quantize_weight(gu), Q.quantize_weight(dn)
    del gu, dn
    return qg["qweight"], qd["qweight"], qg["scale"].reshape(-1), qd["scale"].reshape(-1)


def bench_shape(name, h, inter, e, k, tokens, int8, device, reps, flush) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    gu, dn, gs, ds = layer(h, inter, e, k, int8, device, g)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    wbytes = 1 if int8 else 2
    rows = []
    for t in tokens:
        x = torch.randn(t, h, generator=g, device=device).to(dtype)
        top, ids = torch.randn(t, e, generator=g, device=device).topk(k, dim=-1)
        tw = torch.softmax(top, dim=-1).to(dtype)
        kernel = lambda: FM.fused_moe_triton(x, ids, tw, gu, dn, 0, gs, ds)  # noqa: E731
        reference = lambda: MOE.moe_reference(x, ids, tw, gu, dn, 0, gs, ds)  # noqa: E731
        got, want = kernel(), reference()
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30))
        if not (err <= 3e-2 and torch.isfinite(got).all()):
            raise SystemExit(
                f"{name} T={t}{' int8' if int8 else ''}: the kernel disagrees with the reference "
                f"(max error {err:.3g} of max |ref|): not timing it"
            )
        # the dense MLP of intermediate K*I: same FLOPs; at T = 1 the same weight bytes
        wgu = torch.randn(2 * k * inter, h, generator=g, device=device).to(dtype) / math.sqrt(h)
        wd = torch.randn(h, k * inter, generator=g, device=device).to(dtype) / math.sqrt(k * inter)

        def dense():
            a, b = torch.nn.functional.linear(x, wgu).chunk(2, dim=-1)
            return torch.nn.functional.linear(torch.nn.functional.silu(a) * b, wd)

        ms_kernel = time_ms(graphed(kernel), flush, reps)
        ms_ref = time_ms(reference, flush, max(3, reps // 4))
        ms_dense = time_ms(graphed(dense), flush, reps)
        active = int(torch.unique(ids).numel())
        bytes_w = active * 3 * h * inter * wbytes
        flops = t * k * 6 * h * inter
        row = {
            "shape": name,
            "H": h,
            "I": inter,
            "E": e,
            "K": k,
            "T": t,
            "int8": int8,
            "active_experts": active,
            "ms": ms_kernel,
            "ref_ms": ms_ref,
            "dense_ms": ms_dense,
            "max_err": err,
            "weight_TBps": bytes_w / ms_kernel / 1e9,
            "TFLOPs": flops / ms_kernel / 1e9,
            "dense_TBps": 3 * k * h * inter * 2 / ms_dense / 1e9,
            "dense_TFLOPs": flops / ms_dense / 1e9,
            "speedup_vs_ref": ms_ref / ms_kernel,
            "vs_dense": ms_kernel / ms_dense,
            "config": FM.moe_config(t, h, inter, e, k, FM.arch_of(device), x.element_size(), wbytes),
        }
        rows.append(row)
        wname = "int8" if int8 else str(dtype).removeprefix("torch.")
        print(
            f"{name:14s} {wname} T={t:5d} experts {active:3d}  kernel {ms_kernel:8.3f} ms "
            f"({row['weight_TBps']:5.2f} TB/s, {row['TFLOPs']:6.1f} TFLOP/s)  reference {ms_ref:8.3f} ms "
            f"(x{row['speedup_vs_ref']:5.2f})  dense {ms_dense:8.3f} ms (kernel/dense {row['vs_dense']:5.2f})",
            flush=True,
        )
        wgu = wd = None  # frees them (the timing lambdas hold the names)
    gu = dn = gs = ds = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--int8", action="store_true", help="also W8A16 (int8 weights, per-row scales)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per contender (the reference: a quarter)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--out", help="write every measurement here as JSON")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernels in the Triton interpreter: set TRITON_INTERPRET=1")
        device, shapes, tokens, reps = torch.device("cpu"), SMOKE_SHAPES, SMOKE_TOKENS, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_moe.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
        device, reps = torch.device("cuda"), args.reps
        unknown = set(args.shapes.split(",")) - set(SHAPES)
        if unknown:
            sys.exit(f"unknown shapes {sorted(unknown)}; known: {list(SHAPES)}")
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
        tokens = tuple(int(t) for t in args.tokens.split(","))
    flush = flush_buffer(device)
    t0 = time.time()
    rows = []
    for int8 in (False, True) if args.int8 or args.smoke else (False,):
        for name, (h, inter, e, k) in shapes.items():
            rows += bench_shape(name, h, inter, e, k, tokens, int8, device, reps, flush)
    print(f"{len(rows)} measurements in {time.time() - t0:.0f} s")
    if args.out:
        info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
