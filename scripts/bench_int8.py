"""Benchmark dsc's int8 kernels against torch's bf16 matmul (cuBLAS) on one GPU.

    python scripts/bench_int8.py                # correctness + timings + config sweep (H100/H200)
    python scripts/bench_int8.py --quick        # default configs only
    python scripts/bench_int8.py --aot          # no GPU: build the sm_90 kernels, print registers,
                                                # spills, shared memory and the SASS instruction mix
    TRITON_INTERPRET=1 python scripts/bench_int8.py --smoke   # no GPU: the script itself, tiny shapes

Shapes: W8A16 at decode, batch 1 and 8, K x N = 4096 x 4096, 4096 x 14336, 14336 x 4096
(target: >= 1.7x faster than bf16); W8A8 at prefill, 2048 tokens, same K x N (target: faster
than bf16, activation quantization included). Every kernel/config is checked against the
plain-torch reference before it is timed. Timing: timing.bench_ms (triton.testing.do_bench, median), with the
weights rotated over enough copies to exceed L2 (each call reads its weight from HBM, as a
decode step does) on top of do_bench's own L2 flush.

Writes $OUT/bench_int8.json (every measurement) and $OUT/tuning_int8.json (the fastest config
per shape class, in kernels/tuning.json's format: merge it into the "sm_90" section).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
from timing import bench_ms, capture, checkout_modules

ROOT = Path(__file__).resolve().parents[1]


int8, SWITCHES = checkout_modules("kernels.int8", "switches")

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N): x [M, K] @ W[N, K].T
DECODE_M = (1, 8)
PREFILL_M = 2048
TARGET_DECODE = 1.7

# candidate configs for the sweep (the defaults in kernels/int8.py are always measured too).
# FAST_CVT: int8 -> fp32 on the ALU (inline PTX) instead of I2F; the False rows show its worth.
GEMV = [
    dict(BLOCK_N=bn, BLOCK_K=bk, PREFETCH=pf, X_ROW=False, FAST_CVT=fc, num_warps=w, num_stages=1)
    for bn, bk, w, pf, fc in [
        (8, 1024, 4, False, False),
        (4, 1024, 2, False, False),
        (4, 1024, 2, False, True),
        (4, 2048, 4, False, True),
        (2, 2048, 2, False, True),
        (8, 2048, 8, False, True),
        (16, 1024, 8, False, True),
        (16, 512, 4, False, True),
        (8, 512, 4, True, True),
        (4, 512, 2, True, True),
        (8, 1024, 4, True, True),
        (4, 1024, 2, True, True),
        (16, 512, 8, True, True),
        (2, 1024, 2, True, True),
        # fewer, smaller programs (4096 x 14336 runs 1.7 waves at BLOCK_N 2)
        (4, 512, 2, False, True),
        (4, 256, 1, False, True),
        (2, 256, 1, False, True),
        (2, 512, 1, False, True),
        (1, 1024, 1, False, True),
        (4, 512, 4, False, True),
        (8, 256, 2, False, True),
        # a whole 4096-byte row per K step (one iteration at K = 4096)
        (2, 4096, 2, False, True),
        (4, 4096, 4, False, True),
        (1, 4096, 1, False, True),
        (2, 2048, 1, False, True),
        (4, 2048, 2, False, True),
    ]
]
MMA_DECODE = [
    dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, FAST_CVT=fc, num_warps=w, num_stages=s)
    for bn, bk, w, s, fc in [
        (32, 256, 4, 4, False),
        (16, 256, 2, 4, True),
        (16, 512, 4, 3, True),
        (16, 512, 2, 4, True),
        (32, 512, 4, 3, True),
        (32, 128, 2, 5, True),
        (64, 128, 4, 4, True),
        (64, 256, 4, 3, True),
        (64, 256, 8, 4, True),
        (32, 256, 2, 6, True),
        (16, 1024, 4, 3, True),
        (32, 512, 8, 4, True),
    ]
]
# M = 8 variants: SWAP_AB puts the dequantized weight in the MMA's A operand (N tiles
# of 16-64), SPLIT_K > 1 shares each tile's K-blocks over SPLIT_K programs (one launch: the
# last split sums the fp32 partials); both on the mma kernel. (An FMA kernel for M rows, the
# gemv's scheme, runs 10-50x slower on the H200: not in the sweep.)
MMA_DECODE_VARIANTS = [
    dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, FAST_CVT=True, SWAP_AB=sw, SPLIT_K=sk, num_warps=w, num_stages=s)
    for bn, bk, w, s, sw, sk in [
        (64, 256, 4, 4, True, 1),
        (64, 128, 4, 4, True, 2),
        (64, 256, 4, 3, True, 2),
        (32, 256, 4, 4, True, 1),
        (32, 256, 4, 4, True, 2),
        (32, 256, 2, 4, True, 4),
        (16, 256, 2, 4, True, 4),
        (128, 128, 4, 4, True, 4),
        (64, 128, 4, 4, True, 4),
        (32, 256, 4, 4, False, 2),
        (32, 256, 4, 4, False, 4),
        (64, 256, 4, 4, False, 4),
        (16, 512, 2, 3, False, 4),
        (64, 128, 4, 6, True, 8),
        # deeper split-K and pipelines
        (32, 512, 2, 3, True, 4),
        (32, 256, 2, 4, True, 8),
        (16, 512, 2, 3, True, 8),
        (32, 128, 2, 6, True, 4),
        (64, 256, 4, 4, True, 8),
        (32, 256, 4, 5, False, 1),
        # shallower pipelines: more programs per SM (4096 x 14336
        # at 4 stages runs 448 tiles on 396 slots)
        (32, 256, 4, 3, False, 1),
        (32, 256, 4, 2, False, 1),
        (16, 256, 2, 4, False, 1),
        (16, 512, 2, 3, False, 1),
        (32, 128, 4, 4, False, 1),
        (64, 128, 4, 3, False, 1),
        (32, 256, 2, 3, True, 4),
        (32, 128, 2, 4, True, 4),
        # longer K-blocks, 2-way splits
        (32, 512, 2, 3, True, 2),
        (16, 1024, 2, 2, True, 2),
        (32, 1024, 4, 2, True, 2),
        (16, 512, 2, 4, True, 2),
        (64, 512, 4, 3, True, 2),
        (16, 256, 1, 4, True, 4),
    ]
]
# M = 8: num_stages 1 (register loads, many programs in flight: the M = 1 GEMV's
# scheme, which reads the same weights 10-27% faster), and the I2F conversion (FAST_CVT off:
# triton may convert in the dot operand's layout) with SWAP_AB and split-K
MMA_DECODE_VARIANTS += [
    dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, FAST_CVT=fc, SWAP_AB=sw, SPLIT_K=sk, num_warps=w, num_stages=s)
    for bn, bk, w, s, sw, sk, fc in [
        (16, 256, 1, 1, True, 1, True),
        (16, 512, 1, 1, True, 1, True),
        (16, 1024, 2, 1, True, 1, True),
        (32, 256, 2, 1, True, 1, True),
        (32, 512, 2, 1, True, 1, True),
        (64, 256, 4, 1, True, 1, True),
        (16, 512, 1, 1, True, 2, True),
        (32, 512, 4, 1, True, 1, True),
        (32, 256, 2, 1, False, 1, True),
        (32, 256, 2, 4, True, 4, False),
        (16, 256, 2, 4, True, 4, False),
        (32, 256, 4, 3, False, 1, False),
        (64, 256, 4, 4, False, 1, False),
        (32, 512, 4, 3, False, 1, False),
        (32, 256, 4, 4, False, 2, False),
        (16, 256, 2, 4, False, 1, False),
        (32, 256, 2, 1, True, 1, False),
    ]
]
# M <= 16: the Gluon kernel (REGS; kernels/int8.py `_w8a16_regs_kernel`): weights
# loaded straight into the MMA's operand registers, no shared memory. BLOCK_N rows per program
# (16 per warp and repeat), register bytes per thread BLOCK_N * BLOCK_K / (32 * warps) <= 256
# (<= 128 with PREFETCH's second buffer); split-K for the narrow shapes' grids. On the H200 the
# kernel runs one wave of programs, each K-block a full memory round trip (4096 x 4096: 1024
# warps, ~1.4 us per K-block): so many splits, up to every warp holding its whole share in one or
# two K-blocks.
REGS_DECODE = [
    dict(REGS=True, BLOCK_M=8, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, PREFETCH=False, num_warps=w)
    for bn, w in [(16, 1), (32, 2)]
    for bk in (128, 256)
    for sk in (4, 8, 16, 32)
]
REGS_DECODE += [
    dict(REGS=True, BLOCK_M=8, BLOCK_N=64, BLOCK_K=bk, SPLIT_K=sk, PREFETCH=False, num_warps=4)
    for bk in (128, 256)
    for sk in (8, 16)
]
REGS_DECODE += [
    dict(REGS=True, BLOCK_M=8, BLOCK_N=16, BLOCK_K=128, SPLIT_K=sk, PREFETCH=True, num_warps=1) for sk in (8, 16)
]
# WARPS_K: a program's K range in WARPS_K parts on their own warps (no partials in memory);
# more rows per warp (one x operand for 32-64 rows: half the x traffic) and 64-wide K-blocks
# (tuples: BLOCK_N, WARPS_K, BLOCK_K, SPLIT_K; one warp column, num_warps = WARPS_K).
REGS_DECODE += [
    dict(REGS=True, BLOCK_M=8, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, PREFETCH=False, num_warps=wk, WARPS_K=wk)
    for bn, wk, bk, sk in [
        (32, 4, 128, 1),
        (32, 4, 128, 2),
        (32, 4, 128, 4),
        (32, 2, 128, 4),
        (32, 2, 128, 8),
        (64, 4, 64, 2),
        (64, 4, 64, 4),
        (32, 8, 64, 1),
        (32, 8, 64, 2),
        (16, 4, 64, 8),
        (16, 2, 64, 8),
        (16, 4, 128, 4),
        (32, 4, 64, 4),
        (64, 2, 64, 8),
        (32, 4, 256, 1),
    ]
]
# WARPS_K with BLOCK_N / 16 warp columns, one 16-row MMA tile each
REGS_DECODE += [
    dict(REGS=True, BLOCK_M=8, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, PREFETCH=False, num_warps=wk * bn // 16, WARPS_K=wk)
    for bn, wk, bk, sk in [
        (16, 4, 128, 1),
        (16, 4, 256, 1),
        (16, 8, 128, 1),
        (16, 4, 128, 2),
        (16, 4, 256, 2),
        (16, 8, 128, 2),
        (16, 4, 128, 4),
        (16, 8, 256, 1),
        (32, 4, 128, 1),
        (32, 4, 128, 2),
        (32, 2, 256, 2),
        (16, 2, 256, 4),
        (16, 2, 128, 8),
        (16, 4, 64, 4),
        (16, 8, 64, 2),
        (16, 16, 64, 1),
        (16, 16, 128, 1),
    ]
]
# EARLY: the first K-block's weights loaded before the PDL wait, that block peeled off the loop
# (no value carried into it), at the REGS rows' tiles (BLOCK_N, WARPS_K, BLOCK_K, SPLIT_K).
REGS_DECODE += [
    dict(
        REGS=True,
        BLOCK_M=8,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=sk,
        PREFETCH=False,
        EARLY=True,
        num_warps=wk * bn // 16,
        WARPS_K=wk,
    )
    for bn, wk, bk, sk in [
        (16, 4, 128, 4),
        (16, 4, 128, 1),
        (16, 4, 128, 2),
        (16, 8, 128, 1),
        (16, 2, 128, 8),
        (16, 8, 256, 1),
        (16, 4, 64, 4),
        (16, 4, 256, 1),
        (32, 4, 128, 1),
        (16, 4, 256, 4),
    ]
]
# decode at batch 32-64 (`--decode-m 32,64`): one BLOCK_M tile covers the batch, so the weight
# is read once
MMA_BATCH = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FAST_CVT=True, SWAP_AB=sw, SPLIT_K=sk, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s, sw, sk in [
        (64, 64, 128, 4, 4, False, 1),
        (64, 128, 128, 4, 3, False, 1),
        (64, 64, 128, 4, 4, False, 2),
        (64, 64, 256, 4, 3, False, 4),
        (64, 128, 64, 8, 4, False, 1),
        (64, 64, 128, 4, 4, True, 1),
        (64, 128, 128, 8, 3, True, 2),
        (32, 64, 256, 4, 4, False, 2),
        (64, 32, 256, 4, 4, False, 1),
        (64, 64, 64, 4, 6, False, 1),
    ]
]
W8A8_PREFILL = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in [
        (128, 128, 128, 8, 3),
        (128, 256, 128, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 256, 64, 8, 4),
        (256, 128, 128, 8, 3),
        (64, 256, 128, 4, 3),
        (128, 128, 128, 4, 4),
        (128, 64, 128, 4, 4),
        (64, 128, 128, 4, 4),
        (128, 256, 128, 8, 4),
    ]
]


# -- benchmark ---------------------------------------------------------------------------------
DEVICE = "cuda"
DTYPE = torch.bfloat16  # --smoke: fp16 on CPU (the interpreter's bf16 dot is wrong)


def _arch() -> str:
    """The tuning section the defaults come from: sm_90's (the bench's GPU); --smoke runs on CPU,
    where the launch takes the built-in defaults (the Gluon kernel's rows cannot run there)."""
    return "sm_90" if DEVICE == "cuda" else "default"


def _copies(nbytes: int, l2: int) -> int:
    return max(2, math.ceil(3 * l2 / nbytes))


def _bench(fn, n_copies: int, eager: bool = False) -> float:
    """Median ms per call of fn(i), i rotating over n_copies inputs.

    Default: the n_copies calls captured in one CUDA graph, as the runtime replays a decode step
    (no Python or launch overhead: a few-microsecond kernel timed eagerly is mostly the CPU),
    timed with do_bench (L2 flushed before each replay), divided by n_copies. eager: do_bench of
    one Python call per iteration (what a plain PyTorch loop would see)."""
    if DEVICE != "cuda":  # --smoke: one timed call, the numbers mean nothing
        import time

        t = time.perf_counter()
        fn(0)
        return (time.perf_counter() - t) * 1e3
    if eager:
        state = {"i": 0}

        def call():
            state["i"] = (state["i"] + 1) % n_copies
            fn(state["i"])

        return bench_ms(call, rep=200)
    for i in range(n_copies):  # compile and allocate outside the capture
        fn(i)
    graph, _ = capture(lambda: [fn(i) for i in range(n_copies)])
    ms = bench_ms(graph.replay, rep=200) / n_copies
    del graph
    return ms


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = (ref.double() - got.double()).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


def _setup(m: int, k: int, n: int, l2: int):
    """x [m, k]; the weight as bf16 copies and as int8 copies (enough of each to exceed L2)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(n, k, generator=g, device=DEVICE) / math.sqrt(k)
    p = int8.quantize_weight(w)
    qws = [p["qweight"]] + [p["qweight"].clone() for _ in range(_copies(n * k, l2) - 1)]
    wbf = [w.to(DTYPE) for _ in range(_copies(2 * n * k, l2))]
    x = torch.randn(m, k, generator=g, device=DEVICE).to(DTYPE)
    return x, wbf, qws, p["scale"]


def _sweep(run_cfg, ref: torch.Tensor, cands: list[dict], n_copies: int) -> list[dict]:
    """Check each config against the reference, then time it. run_cfg(cfg, i) -> output."""
    rows = []
    for cfg in cands:
        cfg = dict(cfg)
        row = {"kernel": cfg.pop("kernel", None), "config": cfg}
        try:
            q = _sqnr(ref, run_cfg(row, 0).float())
            if q < 40:
                row["error"] = f"SQNR {q:.1f} dB vs reference"
            else:
                row.update(ms=_bench(lambda i: run_cfg(row, i), n_copies), sqnr_vs_ref_db=round(q, 1))
        except Exception as e:  # a config the compiler rejects (resources) is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def _result(op: str, m: int, k: int, n: int, t_bf16: float, rows: list[dict], **extra) -> dict:
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    d = rows[0]
    return {
        "op": op,
        "M": m,
        "K": k,
        "N": n,
        "bf16_ms": t_bf16,
        "default": d,
        "best": best,
        "speedup_default": t_bf16 / d["ms"] if "ms" in d else None,
        "speedup_best": t_bf16 / best["ms"] if best else None,
        **extra,
        "candidates": rows,
    }


def _eager(res: dict, bf16, run, n_copies: int) -> None:
    """Add eager (Python launch per call) timings of bf16, the default and the best config."""
    res["bf16_eager_ms"] = _bench(bf16, n_copies[0], eager=True)
    for key in ("default", "best"):
        row = res[key]
        if row and "ms" in row and "eager_ms" not in row:
            row["eager_ms"] = _bench(lambda i: run(row, i), n_copies[1], eager=True)


def _pdl(res: dict, run, n_copies: int) -> None:
    """Time the default config with programmatic dependent launch off and on (kernels/launch.py;
    DSC_PDL is read at each launch, so at graph capture): the n_copies back-to-back calls of a
    graph overlap only with it on."""
    row, before = res["default"], os.environ.get("DSC_PDL")
    if "ms" not in row:
        return
    row["pdl_ms"] = {}
    for mode in ("off", "auto"):
        os.environ["DSC_PDL"] = mode
        SWITCHES.reload()  # switches are read once; re-read DSC_PDL
        row["pdl_ms"]["on" if mode == "auto" else "off"] = _bench(lambda i: run(row, i), n_copies)
    if before is None:
        os.environ.pop("DSC_PDL")
        SWITCHES.reload()  # switches are read once; re-read DSC_PDL
    else:
        os.environ["DSC_PDL"] = before
        SWITCHES.reload()  # switches are read once; re-read DSC_PDL


def bench_w8a16(m: int, k: int, n: int, l2: int, sweep: list[dict] | None) -> dict:
    x, wbf, qws, scale = _setup(m, k, n, l2)
    ref = int8.linear_w8a16_reference(x.float(), qws[0], scale, None, None, k)
    bf16 = lambda i: torch.nn.functional.linear(x, wbf[i % len(wbf)])  # noqa: E731
    t_bf16 = _bench(bf16, len(wbf))
    kernel = int8.int8_kernel("w8a16", m)
    cands = [dict(int8.int8_config(kernel, m, n, k, 0, _arch()), kernel=kernel)] + (sweep or [])

    def run(row, i):
        row["kernel"] = row["kernel"] or kernel
        return int8.w8a16_matmul(x, qws[i % len(qws)], scale, None, None, k, kernel=row["kernel"], config=row["config"])

    res = _result("w8a16", m, k, n, t_bf16, _sweep(run, ref, cands, len(qws)))
    _eager(res, bf16, run, (len(wbf), len(qws)))
    _pdl(res, run, len(qws))
    return res


def bench_w8a8(m: int, k: int, n: int, l2: int, sweep: list[dict] | None) -> dict:
    x, wbf, qws, scale = _setup(m, k, n, l2)
    ref = int8.linear_w8a8_reference(x, qws[0], scale, None, None, k, None).float()
    bf16 = lambda i: torch.nn.functional.linear(x, wbf[i % len(wbf)])  # noqa: E731
    t_bf16 = _bench(bf16, len(wbf))
    t_quant = _bench(lambda i: int8.quantize_rows(x), 1)
    cands = [dict(int8.int8_config("w8a8", m, n, k, 0, _arch()), kernel="w8a8")] + (sweep or [])

    def run(row, i):
        row["kernel"] = "w8a8"
        return int8.w8a8_matmul(x, qws[i % len(qws)], scale, None, None, k, None, config=row["config"])

    rows = _sweep(run, ref, cands, len(qws))
    int_mm = None
    if DEVICE == "cuda" and hasattr(torch, "_int_mm"):  # cuBLAS int8 GEMM for reference, no epilogue
        xq, _ = int8.quantize_rows(x)
        qT = [q.t() for q in qws]
        try:
            int_mm = _bench(lambda i: torch._int_mm(xq, qT[i % len(qT)]), len(qT))
        except RuntimeError:
            pass
    res = _result("w8a8", m, k, n, t_bf16, rows, quantize_rows_ms=t_quant, torch_int_mm_ms=int_mm)
    _eager(res, bf16, run, (len(wbf), len(qws)))
    return res


def check_odd_shapes() -> list[str]:
    """Kernels vs references at odd shapes, every scale mode, 16-bit activations."""
    errs = []
    g = torch.Generator(device=DEVICE).manual_seed(1)
    cases = [
        (1, 72, 47, None, True),
        (3, 72, 47, 24, False),
        (8, 200, 130, None, False),
        (37, 256, 96, 64, True),
        (5, 96, 33, 32, False),
    ]
    if DEVICE == "cuda":
        cases.append((1, 4096, 4096, 128, True))
    for dt in (torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float16,):
        for m, k, n, gs, sym in cases:
            w = torch.randn(n, k, generator=g, device=DEVICE)
            p = int8.quantize_weight(w, gs, sym)
            z = None if sym else p["zero"]
            b = torch.randn(n, generator=g, device=DEVICE).to(dt)
            x = torch.randn(m, k, generator=g, device=DEVICE).to(dt)
            ref = int8.linear_w8a16_reference(x.float(), p["qweight"], p["scale"], z, b.float(), gs or k)
            got = int8.w8a16_matmul(x, p["qweight"], p["scale"], z, b, gs or k).float()
            if _sqnr(ref, got) < 35:
                errs.append(f"w8a16 {dt} M{m} K{k} N{n} g{gs} sym={sym}: SQNR {_sqnr(ref, got):.1f} dB")
            if gs is None or gs % 32 == 0:
                ref8 = int8.linear_w8a8_reference(x, p["qweight"], p["scale"], z, b, gs or k, None).float()
                got8 = int8.w8a8_matmul(x, p["qweight"], p["scale"], z, b, gs or k).float()
                if _sqnr(ref8, got8) < 35:
                    errs.append(f"w8a8 {dt} M{m} K{k} N{n} g{gs} sym={sym}: SQNR {_sqnr(ref8, got8):.1f} dB")
    if DEVICE == "cuda":  # through the custom op, as the runtime calls it
        x = torch.randn(2, 3, 72, device=DEVICE, dtype=DTYPE)
        p = int8.quantize_weight(torch.randn(47, 72, device=DEVICE))
        y = torch.ops.dsc.linear_w8a16(x, p["qweight"], p["scale"], None, None, 72)
        if y.shape != (2, 3, 47) or y.dtype != DTYPE:
            errs.append(f"dsc.linear_w8a16 returned {y.dtype}{list(y.shape)}")
    return errs


def run(args) -> dict:
    if DEVICE == "cuda":
        import triton

        props = torch.cuda.get_device_properties(0)
        l2, name, tv = getattr(props, "L2_cache_size", 50 * 2**20), props.name, triton.__version__
    else:
        l2, name, tv = 2**16, "cpu (Triton interpreter, --smoke)", "interpreter"
    shapes, decode_m, prefill_m = (
        (SHAPES, DECODE_M, PREFILL_M) if DEVICE == "cuda" else ([(256, 96), (96, 200)], (1, 8), 64)
    )
    if args.decode_m:
        decode_m = tuple(int(m) for m in args.decode_m.split(","))
    if args.shapes:
        shapes = [tuple(int(v) for v in kn.split("x")) for kn in args.shapes.split(",")]
    sweep = not args.quick
    pick = (lambda c: c) if DEVICE == "cuda" else (lambda c: c[:2])
    res = {
        "device": name,
        "torch": torch.__version__,
        "triton": tv,
        "l2_bytes": l2,
        "correctness_errors": check_odd_shapes(),
        "results": [],
    }
    for err in res["correctness_errors"]:
        print("CORRECTNESS:", err)
    print(f"{name}; torch {torch.__version__}; triton {tv}; L2 {l2 / 2**20:.0f} MiB")
    print(
        "CUDA-graph replay (the runtime's decode path); 'eager' = one Python launch per call; "
        "'pdl off/on': the default config with DSC_PDL=off / auto"
    )
    print(
        f"{'op':6} {'M':>5} {'K':>6} {'N':>6} {'bf16 us':>9} {'int8 us':>9} {'x bf16':>7} "
        f"{'best us':>9} {'x bf16':>7} {'GB/s':>7} {'eager x':>8} {'pdl off/on':>13}  best config"
    )
    for m in decode_m:
        for k, n in shapes:
            cands = None
            if args.configs and 1 < m <= 16:  # the given rows only, next to the default
                cands = [dict(json.loads(c), kernel="w8a16_mma") for c in args.configs]
            elif sweep:
                if m == 1:  # and the tensor-core kernel at M = 1, for comparison
                    cands = pick([dict(c, kernel="w8a16_gemv") for c in GEMV])
                    cands += pick([dict(c, kernel="w8a16_mma") for c in MMA_DECODE[:6]])
                elif m <= 16:
                    regs = [dict(c, kernel="w8a16_mma", BLOCK_M=max(8, 1 << (m - 1).bit_length())) for c in REGS_DECODE]
                    cands = (
                        regs
                        if args.regs
                        else pick([dict(c, kernel="w8a16_mma") for c in MMA_DECODE_VARIANTS + MMA_DECODE] + regs)
                    )
                else:  # decode batches of 17-256 rows (--decode-m 32,64): one row tile of x
                    cands = pick([dict(c, kernel="w8a16_mma") for c in MMA_BATCH])
            elif args.vs_mma and 1 < m <= 16:  # the Triton mma kernel's built-in default next to the default
                cands = [dict(int8.int8_config("w8a16_mma", m, n, k, 0, "sm_90", table=False), kernel="w8a16_mma")]
            r = bench_w8a16(m, k, n, l2, cands)
            res["results"].append(r)
            _print_row(r, n * k)
            for row in r["candidates"][1:] if args.configs else ():
                got = (
                    f"{row['ms'] * 1e3:7.2f} us ({r['bf16_ms'] / row['ms']:.2f}x bf16)"
                    if "ms" in row
                    else row.get("error")
                )
                print(f"    {got}  {json.dumps(row['config'])}")
    for k, n in shapes if not args.no_prefill else ():
        r = bench_w8a8(prefill_m, k, n, l2, pick([dict(c) for c in W8A8_PREFILL]) if sweep else None)
        res["results"].append(r)
        _print_row(r, n * k)
    dec = [r for r in res["results"] if r["op"] == "w8a16"]
    pre = [r for r in res["results"] if r["op"] == "w8a8"]
    worst = lambda rows, key: min((r[key] or 0.0 for r in rows), default=0.0)  # noqa: E731
    res["targets"] = {
        "w8a16_decode_min_speedup_best": worst(dec, "speedup_best"),
        "w8a16_decode_min_speedup_default": worst(dec, "speedup_default"),
        "w8a8_prefill_min_speedup_best": worst(pre, "speedup_best"),
        "w8a8_prefill_min_speedup_default": worst(pre, "speedup_default"),
    }
    t = res["targets"]  # (0.00x where a row's default failed; a summary only for the ops run)
    if dec:
        print(
            f"W8A16 decode: min speedup over bf16 {t['w8a16_decode_min_speedup_best']:.2f}x with the best configs, "
            f"{t['w8a16_decode_min_speedup_default']:.2f}x with the defaults (target {TARGET_DECODE}x)"
        )
    if pre:
        print(
            f"W8A8 prefill ({prefill_m} tokens, activation quantization included): min speedup "
            f"{t['w8a8_prefill_min_speedup_best']:.2f}x best, {t['w8a8_prefill_min_speedup_default']:.2f}x defaults "
            f"(target > 1x)"
        )
    return res


def _print_row(r: dict, weight_elems: int) -> None:
    d, b = r["default"], r["best"]
    us = lambda row: f"{row['ms'] * 1e3:9.1f}" if row and "ms" in row else f"{'-':>9}"  # noqa: E731
    x = lambda v: f"{v:7.2f}" if v else f"{'-':>7}"  # noqa: E731
    gbs = f"{weight_elems / (b['ms'] * 1e-3) / 1e9:7.0f}" if b else f"{'-':>7}"
    ex = (
        f"{r['bf16_eager_ms'] / b['eager_ms']:8.2f}"
        if b and b.get("eager_ms") and r.get("bf16_eager_ms")
        else f"{'-':>8}"
    )
    cfg = json.dumps({"kernel": b["kernel"], **b["config"]}) if b else ""
    pdl = d.get("pdl_ms")
    pdl = f"{pdl['off'] * 1e3:6.1f}/{pdl['on'] * 1e3:<6.1f}" if pdl else f"{'-':>13}"
    print(
        f"{r['op']:6} {r['M']:>5} {r['K']:>6} {r['N']:>6} {r['bf16_ms'] * 1e3:9.1f} {us(d)} "
        f"{x(r['speedup_default'])} {us(b)} {x(r['speedup_best'])} {gbs} {ex} {pdl}  {cfg}"
    )
    if "ms" not in d:
        print(f"       default config failed: {d.get('error')}")


def tuning_rows(res: dict) -> dict:
    """The fastest config per (kernel, shape class), as kernels/tuning.json rows for sm_90.
    The kernel is chosen by M (gemv at M == 1); a row whose winner is the other kernel is left
    out (bench_int8.json has it)."""
    out: dict = {}
    for r in res["results"]:
        b = r["best"]
        want = "w8a8" if r["op"] == "w8a8" else int8.int8_kernel("w8a16", r["M"])
        if b and b["kernel"] == want:
            out.setdefault(want, {})[f"M{int8.m_bucket(r['M'])}_N{r['N']}_K{r['K']}"] = b["config"]
    return {"sm_90": out}


# -- ahead-of-time build for sm_90 (no GPU) ----------------------------------------------------
SASS_COUNTS = {
    "LDG.128": r"\bLDG\.[A-Z.]*128",
    "LDGSTS": r"LDGSTS",
    "HGMMA": r"HGMMA",
    "IGMMA": r"IGMMA",
    "HMMA": r"HMMA",
    "IMMA": r"IMMA",
    "I2F": r"\bI2F",
    "LDL/STL": r"\b(?:LDL|STL)\b",
    "STS": r"\bSTS\b",
    "LDS": r"\bLDS\b",
    "LDSM": r"\bLDSM\b",
    "BAR": r"\bBAR\b",
    "FFMA": r"\bFFMA\b",
}


def run_aot() -> None:
    """Build the default-config kernels at the benchmark shapes for sm_90 with the argument
    attributes a real launch gets (16-byte aligned pointers, K/N/strides divisible by 16) and
    print what ptxas made of them."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsc.kernels.launch import gluon_triton_jit, triton_jit

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    div16 = {"N", "K", "stride_xm", "stride_ym"}

    def build(fn, types, const, opts, gluon=False):
        from triton.experimental.gluon._runtime import GluonASTSource

        kern = gluon_triton_jit(fn) if gluon else triton_jit(fn)
        const = {**{p.name: p.default for p in kern.params if p.is_constexpr and p.has_default}, **const}
        sig = {**types, **{k: "constexpr" for k in const}}
        names = [a for a in kern.arg_names]
        sig = {a: sig[a] for a in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if sig[a].startswith("*") or a in div16}
        k = triton.compile(
            (GluonASTSource if gluon else ASTSource)(kern, sig, const, attrs),
            target=GPUTarget("cuda", 90, 32),
            options=opts,
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([bindir / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([bindir / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        regs = re.search(r"REG:(\d+)", res)
        stack = re.search(r"STACK:(\d+)", res)
        mix = {name: len(re.findall(pat, sass)) for name, pat in SASS_COUNTS.items()}
        return (
            f"regs {regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'} "
            f"smem {k.metadata.shared} | " + " ".join(f"{k_} {v}" for k_, v in mix.items())
        )

    ptr = lambda s, t: {n: t for n in s.split()}  # noqa: E731
    i32 = lambda s: {n: "i32" for n in s.split()}  # noqa: E731
    decode_variants = [
        ("w8a16_mma", dict(SWAP_AB=True, BLOCK_N=64)),
        ("w8a16_mma", dict(SWAP_AB=True, BLOCK_N=32, SPLIT_K=2)),
        ("w8a16_mma", dict(SPLIT_K=4)),
    ]
    for m, (k, n) in [(1, SHAPES[0]), (8, SHAPES[0]), (PREFILL_M, SHAPES[0])]:
        kernels = {
            1: [("w8a16_gemv", {}), ("w8a16_gemv", dict(PDL=True))],
            8: [("w8a16_mma", {}), ("w8a16_mma", dict(PDL=True))] + decode_variants,
        }.get(m) or [("w8a8", {})]
        for kernel, variant in kernels:
            row = int8.int8_config(kernel, m, n, k, 0, "sm_90")
            if row.get("REGS"):  # the table runs the Gluon kernel here: it, and the mma kernel at its default
                if set(variant) <= {"PDL"}:
                    mma = {
                        **ptr("X B Y", "*bf16"),
                        **ptr("W Z", "*i8"),
                        "S": "*fp32",
                        "P": "*fp32",
                        "LOCK": "*i32",
                        **i32("M N K G stride_xm stride_ym"),
                    }
                    const = dict(
                        GROUP_K=0,
                        HAS_ZERO=False,
                        HAS_BIAS=False,
                        PDL=variant.get("PDL", False),
                        **int8.regs_constexprs(row),
                    )
                    res = build(int8._w8a16_regs_kernel, mma, const, {"num_warps": row["num_warps"]}, gluon=True)
                    print(f"w8a16_regs  M{m} K{k} N{n} {row} {variant}: {res}")
                row = int8.int8_config(kernel, m, n, k, 0, "sm_90", table=False)
            cfg = {**({"SWAP_AB": False, "SPLIT_K": 1} if kernel == "w8a16_mma" else {}), **row, **variant}
            const, opts = int8._split(cfg, torch.device("cuda"))
            flags = dict(GROUP_K=0, HAS_ZERO=False, HAS_BIAS=False)
            if kernel == "w8a16_gemv":
                fn, types = (
                    int8._w8a16_gemv_kernel,
                    {**ptr("X B Y", "*bf16"), **ptr("W Z", "*i8"), "S": "*fp32", **i32("N K G")},
                )
            elif kernel == "w8a16_mma":
                fn, types = (
                    int8._w8a16_mma_kernel,
                    {
                        **ptr("X B Y", "*bf16"),
                        **ptr("W Z", "*i8"),
                        "S": "*fp32",
                        "P": "*fp32",
                        "LOCK": "*i32",
                        **i32("M N K G stride_xm stride_ym"),
                    },
                )
                flags["PRECISION"] = "tf32"
            else:
                fn, types = (
                    int8._w8a8_kernel,
                    {**ptr("B Y", "*bf16"), **ptr("XQ W Z", "*i8"), **ptr("XS S", "*fp32"), **i32("M N K G stride_ym")},
                )
            print(f"{kernel:11} M{m} K{k} N{n} {cfg}: {build(fn, types, {**flags, **const}, opts)}")
    types = {"X": "*bf16", "INV": "*fp32", "Q": "*i8", "XS": "*fp32", **i32("K stride_xm")}
    print(
        f"{'quantize_rows':11} K4096: "
        f"{build(int8._quantize_rows_kernel, types, dict(HAS_SMOOTH=True, BLOCK_K=2048), {'num_warps': 8})}"
    )


def main() -> None:
    global DEVICE, DTYPE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="default configs only, no sweep")
    ap.add_argument("--aot", action="store_true", help="no GPU: build for sm_90 and print resource usage")
    ap.add_argument("--decode-m", default="", help="decode token counts to run, e.g. 8 (default: 1,8)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the W8A8 prefill shapes")
    ap.add_argument("--shapes", default="", help="K x N weight shapes, e.g. 4096x1536,1024x4096 (default: Llama-8B's)")
    ap.add_argument(
        "--vs-mma",
        action="store_true",
        help="with --quick: also time the Triton mma kernel's built-in "
        "default at 2-16 tokens (where the default is the Gluon kernel)",
    )
    ap.add_argument("--regs", action="store_true", help="at 2-16 tokens sweep only the Gluon kernel's (REGS) configs")
    ap.add_argument(
        "--configs",
        nargs="*",
        default=[],
        help="at 2-16 tokens time these configs (JSON objects, e.g. "
        '\'{"REGS": true, "BLOCK_M": 8, ...}\') next to the default, each printed, instead of a sweep',
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="no GPU: this script's logic on tiny shapes in the "
        "Triton interpreter (set TRITON_INTERPRET=1); timings are meaningless",
    )
    args = ap.parse_args()
    if args.aot:
        run_aot()
        return
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("bench_int8 --smoke: run with TRITON_INTERPRET=1")
        DEVICE, DTYPE = "cpu", torch.float16
    elif not torch.cuda.is_available():
        sys.exit("bench_int8: needs a CUDA GPU (or --aot / --smoke)")
    res = run(args)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_int8.json").write_text(json.dumps(res, indent=1, default=str))
        (Path(out) / "tuning_int8.json").write_text(json.dumps(tuning_rows(res), indent=1, sort_keys=True))
        print(f"wrote {out}/bench_int8.json, {out}/tuning_int8.json")
    if res["correctness_errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
