"""GPU check section `int8`: the Gluon W8A16 kernel (`REGS` configs of w8a16_mma, kernels/int8.py
`_w8a16_regs_kernel`) on a GPU: it cannot run in the Triton interpreter, so this is its
correctness check.

    pytest tests/gpu/test_gpu_int8.py        # about two minutes on an H200 (mostly builds)

Every case runs the REGS kernel, the plain-torch reference (fp32) and the Triton mma kernel
(the same arithmetic: 16-bit products summed in fp32) on the same inputs: batch 1-16, odd and
Llama-8B sizes, per-channel and grouped scales, zero points, bias, split-K, K parts over warps (WARPS_K), register
prefetch, EARLY,
bf16 and fp16. Pass: SQNR against the reference >= 40 dB, and the REGS output within 2 ulps of
the output dtype (of max |y|) of the mma kernel's. Also: split-K replayed from a CUDA graph
with new inputs (its counters reset), and the table's configs through `dsc::linear_w8a16`.
Writes $OUT/gpu_int8.json when OUT is set.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_util import write_summary

from dsc.kernels import int8

CFGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, PREFETCH, num_warps, WARPS_K[, EARLY]
    (8, 16, 256, 1, False, 1, 1),
    (8, 32, 128, 2, True, 1, 1),
    (16, 64, 256, 4, False, 4, 1),
    (8, 64, 512, 1, True, 2, 1),
    (16, 16, 64, 3, False, 1, 1),
    (8, 32, 256, 4, True, 2, 1),
    (8, 16, 128, 1, False, 4, 4),
    (8, 32, 256, 8, False, 4, 2),
    (16, 16, 64, 2, True, 8, 8),
    (8, 16, 128, 4, True, 4, 4),
    # EARLY (8th field): the first K-block's weights before the PDL wait
    (8, 16, 128, 4, False, 4, 4, True),
    (16, 16, 64, 2, True, 8, 8, True),
    (8, 32, 256, 1, False, 2, 1, True),
    # EARLY 2: the first two K-blocks (parts of 1, 2 and 4 blocks)
    (8, 16, 128, 4, False, 4, 4, 2),
    (8, 16, 256, 1, False, 8, 8, 2),
    (16, 16, 64, 2, False, 8, 8, 2),
]
SHAPES = [  # M, K, N, group size (None: per channel), symmetric, bias
    (8, 4096, 4096, None, True, False),
    (8, 4096, 14336, None, True, False),
    (8, 14336, 4096, None, True, False),
    (1, 4096, 4096, None, True, True),
    (5, 4096, 1024, 128, False, True),
    (16, 1024, 3072, None, False, False),
    (3, 1000, 130, None, True, True),
    (13, 192, 47, 64, True, False),
    (7, 256, 96, None, False, True),
    (9, 512, 100, 256, False, False),
]


def sqnr(ref, got) -> float:
    noise = (ref.double() - got.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


def case(m, k, n, gs, sym, bias, dtype, cfg, g) -> str:
    w = torch.randn(n, k, generator=g, device="cuda") / math.sqrt(k)
    p = int8.quantize_weight(w, gs, sym)
    z = None if sym else p["zero"]
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    ref = int8.linear_w8a16_reference(x.float(), p["qweight"], p["scale"], z, None if b is None else b.float(), gs or k)
    bm, bn, bk, sk, pf, warps, wk, *early = cfg
    regs = dict(
        REGS=True,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=sk,
        PREFETCH=pf,
        num_warps=warps,
        WARPS_K=wk,
        EARLY=int(early[0]) if early else 0,
    )
    if gs and gs % bk:
        return "skip"
    got = int8.w8a16_matmul(x, p["qweight"], p["scale"], z, b, gs or k, kernel="w8a16_mma", config=regs)
    mma = int8.w8a16_matmul(
        x,
        p["qweight"],
        p["scale"],
        z,
        b,
        gs or k,
        kernel="w8a16_mma",
        config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64 if gs == 64 else 128, num_warps=4, num_stages=3),
    )
    if got.dtype != dtype or got.shape != (m, n) or not torch.isfinite(got).all():
        return f"bad output {got.dtype} {list(got.shape)}"
    q = sqnr(ref, got.float())
    ulp = torch.finfo(dtype).eps * float(mma.float().abs().max())
    diff = float((got.float() - mma.float()).abs().max())
    if q < 40 or diff > 2 * ulp:
        return f"SQNR {q:.1f} dB, max |regs - mma| {diff:.3g} (2 ulp {2 * ulp:.3g})"
    return "ok"


def graph_replay(g) -> str:
    """split-K from a CUDA graph, replayed with new x: equals an eager call each time."""
    m, k, n = 8, 4096, 4096
    p = int8.quantize_weight(torch.randn(n, k, generator=g, device="cuda") / 64)
    cfg = dict(REGS=True, BLOCK_M=8, BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, PREFETCH=False, num_warps=2, WARPS_K=2)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    run = lambda: int8.w8a16_matmul(x, p["qweight"], p["scale"], None, None, k, kernel="w8a16_mma", config=cfg)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    for _ in range(3):
        x.copy_(torch.randn(m, k, generator=g, device="cuda"))
        graph.replay()
        want = run()
        if not torch.equal(y, want):
            return f"replay differs from eager by {float((y.float() - want.float()).abs().max()):.3g}"
    return "ok"


def through_op(g) -> str:
    """`dsc::linear_w8a16` at M = 8 on the table's config (REGS where a row says so), and at
    shapes without a row on each form of `regs_default` (K x N 4096 x 6144: 8 K parts of 256;
    4096 x 1536: split-K 4; 1024 x 4096: one 256-wide block per part; 8192 x 2048: the long-K
    form; 4096 x 7168: 8 parts of 128; 2048 x 16384: 4 parts of 128)."""
    out = []
    for k, n in (
        (4096, 4096),
        (4096, 14336),
        (14336, 4096),
        (4096, 6144),
        (4096, 1536),
        (1024, 4096),
        (8192, 2048),
        (4096, 7168),
        (2048, 16384),
    ):
        cfg = int8.int8_config("w8a16_mma", 8, n, k, 0, "sm_90")
        p = int8.quantize_weight(torch.randn(n, k, generator=g, device="cuda") / math.sqrt(k))
        x = torch.randn(2, 4, k, generator=g, device="cuda").to(torch.bfloat16)
        y = torch.ops.dsc.linear_w8a16(x, p["qweight"], p["scale"], None, None, k)
        ref = int8.linear_w8a16_reference(x.float(), p["qweight"], p["scale"], None, None, k)
        q = sqnr(ref, y.float())
        out.append(f"K{k}N{n} REGS={bool(cfg.get('REGS'))} {q:.1f} dB")
        if q < 40:
            return "FAIL " + "; ".join(out)
    return "ok: " + "; ".join(out)


@pytest.mark.gpu
def test_w8a16_regs_kernel():
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "cases": {}}
    for dtype in (torch.bfloat16, torch.float16):
        for shape in SHAPES:
            for cfg in CFGS:
                name = (
                    f"{str(dtype)[6:]} M{shape[0]}K{shape[1]}N{shape[2]} g{shape[3]} sym={shape[4]} bias={shape[5]} "
                    f"cfg={cfg}"
                )
                try:
                    r = case(*shape, dtype, cfg, g)
                except Exception as e:  # noqa: BLE001  a build or launch error is a failed case
                    r = f"{type(e).__name__}: {str(e)[:300]}"
                res["cases"][name] = r
                if r not in ("ok", "skip"):
                    print("FAIL", name, r)
    for name, fn in (("graph-replay-splitk", graph_replay), ("through-op", through_op)):
        try:
            res["cases"][name] = fn(g)
        except Exception as e:  # noqa: BLE001
            res["cases"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        print(name, res["cases"][name])
    bad = {k: v for k, v in res["cases"].items() if v != "skip" and not v.startswith("ok")}
    ran = sum(v != "skip" for v in res["cases"].values())
    res["passed"], res["ran"] = ran - len(bad), ran
    print(f"int8 section: {ran - len(bad)}/{ran} passed on {res['device']}")
    write_summary("gpu_int8", res)
    assert not bad, bad
