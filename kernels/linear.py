"""16-bit linears of the decode program: `dsc::linear(x, weight, bias)` = F.linear.

At one token per sequence (batch 1 decode) a linear is a matrix-vector product: it reads the
weight once and does nothing else, so its time is bytes / bandwidth plus launch latency.
cuBLAS's kernels for M = 1 measured 1.3-3.2 TB/s on an H200 at Llama-1B and GPT-2-XL shapes
(nvjet tiles of 64 x 8 and split-K with a second reduce kernel; `dsc bench --profile`), and at
M = 1 torch adds an unfused bias as a copy kernel before the GEMV.

    _gemv_kernel   M == 1: each program streams BLOCK_N rows of the weight [N, K] (K
                   contiguous) with 16-byte loads, multiplies by x in fp32 registers and
                   reduces once at the end; the bias is added in the same kernel. No tensor
                   cores (nothing to reuse at M == 1), no split-K (N / BLOCK_N programs keep
                   every SM's loads in flight at the shapes tuned).
M > 1, and shapes without a tuned row, run F.linear (cuBLAS), as aten.linear would.

Launch configurations come from kernels/tuning.json's "gemv" rows per shape class "N<n>_K<k>";
scripts/tune_gemv.py writes a row only where the best config beat cuBLAS at that shape on the
GPU it ran on (the row keeps both times). `plan_kernels` records the choice per node.
The CPU implementation and the test oracle is F.linear.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dsc.kernels.launch import arch_of, cdiv, device, jit, next_power_of_2, pdl_options, planner, tuning_table

tl = None  # triton.language, bound by launch.jit on first launch


@device
def _gemv_rows(X, W, offs_n, mask_n, K, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               X_ROW: tl.constexpr, PDL: tl.constexpr):
    # y[n] = sum_k x[k] * w[n, k] for this program's rows offs_n, in fp32 ([BLOCK_N]); with PDL
    # it waits (gdc_wait) after the first weight tile's load and before any other access.
    # Shared by the GEMV kernel and the GEMV that pushes its rows to the all-reduce
    # (kernels/collectives.py)
    rows = offs_n.to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # per-lane partial sums, reduced once
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + cols
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks, plain vector loads
            w = tl.load(W + rows[:, None] + offs_k[None, :], eviction_policy="evict_first")
        else:
            mask = mask_n[:, None] & (offs_k < K)[None, :]
            w = tl.load(W + rows[:, None] + offs_k[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        if PDL:  # only the first weight tile (read-only) loads before the wait, while the previous
            if k0 == 0:  # kernel finishes (a wait in the loop: it is not software-pipelined)
                tl.extra.cuda.gdc_wait()
        # x read as a [BLOCK_N, BLOCK_K] broadcast in w's layout: each thread loads only the
        # x values its lanes need, and the loop has no layout conversion (no barrier)
        # (X_ROW: x read once as [BLOCK_K] and broadcast over the rows, fewer loads at BLOCK_N > 1)
        if EVEN:
            if X_ROW:
                x = tl.load(X + offs_k)[None, :]
            else:
                x = tl.load(X + offs_k[None, :] + 0 * rows[:, None])
        else:
            if X_ROW:
                x = tl.load(X + offs_k, mask=offs_k < K, other=0.0)[None, :]
            else:
                x = tl.load(X + offs_k[None, :] + 0 * rows[:, None], mask=mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)
    if PDL:  # K == 0: no K-block waited above
        if K == 0:
            tl.extra.cuda.gdc_wait()
    return tl.sum(acc, axis=1)


def _gemv_kernel(X, W, B, Y, N, K, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_ROW: tl.constexpr, PDL: tl.constexpr = False):
    # y[n] = sum_k x[k] * w[n, k] (+ b[n])            x: [K], w: [N, K], y: [N]
    if PDL:  # kernels/launch.py: the next kernel's programs may start now
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = _gemv_rows(X, W, offs_n, mask_n, K, EVEN, BLOCK_N, BLOCK_K, X_ROW, PDL)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


# -- configs -----------------------------------------------------------------------------------
GEMV_MODES = ("tuned", "off", "all")


def gemv_mode() -> str:
    mode = os.environ.get("DSC_GEMV", "tuned")
    if mode not in GEMV_MODES:
        raise ValueError(f"DSC_GEMV must be one of {', '.join(GEMV_MODES)}, got {mode!r}")
    return mode


def gemv_config(n: int, k: int, arch: str, mode: str | None = None) -> dict | None:
    """The tuned GEMV config {"BLOCK_N", "BLOCK_K", "num_warps"} for a weight [n, k] on this
    arch, or None where cuBLAS serves (no row: untuned, or cuBLAS was as fast).
    DSC_GEMV (read at each call; CUDA graphs read it at capture): "tuned" (default), "off"
    (cuBLAS everywhere), "all" (the GEMV at every shape, untuned ones with `default_gemv_config`:
    for checking the kernel inside small models). `mode` overrides DSC_GEMV (the planner plans
    "tuned": what runs on the target unless someone sets the variable there)."""
    mode = mode or gemv_mode()
    if mode == "off":
        return None
    row = tuning_table().get(arch, {}).get("gemv", {}).get(f"N{n}_K{k}")
    if not row:
        return default_gemv_config(k) if mode == "all" else None
    return {key: row[key] for key in ("BLOCK_N", "BLOCK_K", "num_warps", "X_ROW") if key in row}


def default_gemv_config(k: int) -> dict:
    """4 rows per program, K-blocks of up to 512, about 8 elements (16 bytes) per thread."""
    block_k = min(512, next_power_of_2(k))
    return {"BLOCK_N": 4, "BLOCK_K": block_k, "num_warps": max(1, min(4, 4 * block_k // 256))}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """x [K] or [1, K] (any leading dims of one row) -> [..., N] with the GEMV kernel."""
    n, k = weight.shape
    if x.numel() != k or x.dtype != weight.dtype:
        raise ValueError(f"gemv: x {x.dtype}{list(x.shape)} does not match one row of weight "
                         f"{weight.dtype}{list(weight.shape)}")
    if weight.stride(1) != 1 or weight.stride(0) != k:
        raise ValueError("gemv: the weight must be contiguous [N, K]")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias must be {x.dtype}[{n}], got {bias.dtype}{list(bias.shape)}")
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    cfg = {"X_ROW": False, **config}
    num_warps = cfg.pop("num_warps")
    even = n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0
    jit(_gemv_kernel)[(cdiv(n, cfg["BLOCK_N"]),)](
        x.contiguous(), weight, bias if bias is not None else weight, y, n, k,
        HAS_BIAS=bias is not None, EVEN=even, num_warps=num_warps, **cfg, **pdl_options(x.device))
    return y


# -- custom op -----------------------------------------------------------------------------------
@torch.library.custom_op("dsc::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@linear.register_kernel("cuda")
def _(x, weight, bias=None):
    n, k = weight.shape
    if x.numel() == k and x.dtype == weight.dtype and weight.is_contiguous():
        cfg = gemv_config(n, k, arch_of(x.device))
        if cfg is not None:
            return gemv(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


# -- planner (plan_kernels) ------------------------------------------------------------------------
@planner("dsc.linear.default")
def _plan_linear(x, weight, bias=None, *, arch):
    """Counted at one row (batch 1 decode, as plan_kernels counts the decode step): the GEMV
    (bias fused) where tuned, else cuBLAS (a biased M = 1 cuBLAS linear is 2 launches)."""
    n, k = weight.shape
    has_bias = bias is not None
    cfg = gemv_config(n, k, arch, mode="tuned")
    if cfg is None:
        return {"name": "cublas.gemm", "config": {"N": n, "K": k, "bias": has_bias}, "launches": 2 if has_bias else 1}
    return {"name": "triton.gemv", "config": {"N": n, "K": k, "bias": has_bias, **cfg, "M>1": "cublas.gemm"},
            "launches": 1}
