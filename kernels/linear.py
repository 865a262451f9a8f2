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

`dsc::linear_swiglu(x, weight)` = swiglu of the two halves of F.linear(x, weight), weight the
fused [gate; up] of an MLP (the decode_linears pass makes it of the gate_up `dsc::linear` and
the `dsc::swiglu` that reads its halves):
    _gemv_swiglu_kernel  M == 1 where the weight's shape has a tuned GEMV row: the GEMV loop
                   (`_gemv_rows`) over a tile of the BLOCK_N gate rows and the BLOCK_N up rows
                   of the same outputs, each result rounded to the dtype as the linear's output
                   is, then activation.py's swiglu; one launch where the pair takes two, and the
                   [.., 2N] gate_up output is never written or read back.
Elsewhere the two ops (their kernels on CUDA), with the same values.

With PDL a GEMV program loads its first weight tile before waiting for the previous kernel; a
row's `EARLY` (K-blocks) makes that its first EARLY K-blocks, one peeled tile, so that more of
the weight streams in while the previous kernel ends. Rows set it where whole decode steps
measured faster (Llama-8B's tp=1 and tp=2 GEMVs at 8 blocks: tp=1 -54 us and tp=2
-50 us per step on 4 H200s; at tp=4's shapes 8 blocks cost 36 us, and in one-GPU bounds a deeper
gate_up preload slowed the norm before it as much as it gained).
Launch configurations come from kernels/tuning.json's "gemv" rows per shape class "N<n>_K<k>";
scripts/tune_gemv.py writes a row only where the best config beat cuBLAS at that shape on the
GPU it ran on (the row keeps both times). `plan_kernels` records the choice per node.
The CPU implementation and the test oracle is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc import switches
from dsc.kernels.activation import _plan_swiglu, _silu_mul, swiglu_reference
from dsc.kernels.launch import arch_of, cdiv, device, jit, next_power_of_2, pdl_options, planner, tuning_table
from dsc.kernels.registry import cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch


@device
def _w_tile(W, rows, offs, mask_n, K, EVEN: tl.constexpr):
    # the weight tile [rows, columns offs] of `_gemv_rows` (masked unless EVEN), streamed past L2
    if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks, plain vector loads
        w = tl.load(W + rows[:, None] + offs[None, :], eviction_policy="evict_first")
    else:
        mask = mask_n[:, None] & (offs < K)[None, :]
        w = tl.load(W + rows[:, None] + offs[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    return w


@device
def _x_tile(X, rows, offs, mask_n, K, EVEN: tl.constexpr, X_ROW: tl.constexpr):
    # x at columns offs, read as a [rows, columns] broadcast in the weight tile's layout: each
    # thread loads only the x values its lanes need, and the loop has no layout conversion (no
    # barrier) (X_ROW: x read once as [columns] and broadcast over the rows, fewer loads at
    # BLOCK_N > 1)
    if EVEN:
        if X_ROW:
            x = tl.load(X + offs)[None, :]
        else:
            x = tl.load(X + offs[None, :] + 0 * rows[:, None])
    else:
        if X_ROW:
            x = tl.load(X + offs, mask=offs < K, other=0.0)[None, :]
        else:
            mask = mask_n[:, None] & (offs < K)[None, :]
            x = tl.load(X + offs[None, :] + 0 * rows[:, None], mask=mask, other=0.0)
    return x


@device
def _gemv_rows(
    X,
    W,
    offs_n,
    mask_n,
    K,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ROW: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_K: tl.constexpr = 0,
):
    # y[n] = sum_k x[k] * w[n, k] for this program's rows offs_n, in fp32 ([BLOCK_N]); with PDL
    # it waits (gdc_wait) after the first weight tile's load and before any other access.
    # EARLY_K > 0 (a multiple of BLOCK_K, at most K): the first EARLY_K columns of the rows are one
    # tile, loaded before the wait, so that more of the weight streams in while the previous
    # kernel ends (`gemv_launch`); the loop then starts at EARLY_K.
    # Shared by the GEMV kernel, the GEMV + swiglu (its rows: gate and up rows interleaved) and
    # the GEMV that pushes its rows to the all-reduce (kernels/collectives.py)
    rows = offs_n.to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # per-lane partial sums, reduced once
    start = 0
    early = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if EARLY_K > 0:
        offs_e = tl.arange(0, EARLY_K)
        we = _w_tile(W, rows, offs_e, mask_n, K, EVEN)
        if PDL:
            tl.extra.cuda.gdc_wait()
        xe = _x_tile(X, rows, offs_e, mask_n, K, EVEN, X_ROW)
        early = tl.sum(we.to(tl.float32) * xe.to(tl.float32), axis=1)
        start = EARLY_K
    for k0 in range(start, K, BLOCK_K):
        offs_k = k0 + cols
        w = _w_tile(W, rows, offs_k, mask_n, K, EVEN)
        if PDL and EARLY_K == 0:  # only the first weight tile (read-only) loads before the wait, while
            if k0 == 0:  # the previous kernel finishes (a wait in the loop: it is not software-pipelined)
                tl.extra.cuda.gdc_wait()
        x = _x_tile(X, rows, offs_k, mask_n, K, EVEN, X_ROW)
        acc += w.to(tl.float32) * x.to(tl.float32)
    if PDL and EARLY_K == 0:  # K == 0: no K-block waited above
        if K == 0:
            tl.extra.cuda.gdc_wait()
    return early + tl.sum(acc, axis=1)


def _gemv_kernel(
    X,
    W,
    B,
    Y,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ROW: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY_K: tl.constexpr = 0,
):
    # y[n] = sum_k x[k] * w[n, k] (+ b[n])            x: [K], w: [N, K], y: [N]
    if PDL:  # kernels/launch.py: the next kernel's programs may start now
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = _gemv_rows(X, W, offs_n, mask_n, K, EVEN, BLOCK_N, BLOCK_K, X_ROW, PDL, EARLY_K)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


def _gemv_swiglu_kernel(
    X,
    W,
    Y,
    N,
    K,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ROW: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY_K: tl.constexpr = 0,
):
    # y[n] = silu(g[n]) * u[n], g[n] = w[n] . x, u[n] = w[N + n] . x     x: [K], w: [2N, K], y: [N]
    if PDL:  # kernels/launch.py: the next kernel's programs may start now
        tl.extra.cuda.gdc_launch_dependents()
    # one tile of 2 BLOCK_N weight rows, gate and up interleaved (row 2i: gate of output n0 + i,
    # row 2i + 1: its up), so one loop and one reduction serve both and a [BLOCK_N, 2] split
    # pairs them
    i = tl.arange(0, 2 * BLOCK_N)
    offs_n = tl.program_id(0) * BLOCK_N + i // 2
    mask_n = offs_n < N
    gu = _gemv_rows(
        X, W, offs_n + (i % 2) * N, mask_n, K, EVEN, 2 * BLOCK_N, BLOCK_K, X_ROW, PDL, EARLY_K
    )  # [2 BLOCK_N]
    g, u = tl.split(tl.reshape(gu, (BLOCK_N, 2)))  # [BLOCK_N] each
    # rounded to the dtype as the unfused linear's output is, then the swiglu kernel's math
    dt = Y.dtype.element_ty
    y = _silu_mul(g.to(dt).to(tl.float32), u.to(dt).to(tl.float32), dt)
    offs_y = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(Y + offs_y, y, mask=offs_y < N)


# -- configs -----------------------------------------------------------------------------------
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "X_ROW", "EARLY")  # what a tuning row sets


def gemv_config(n: int, k: int, arch: str, mode: str | None = None) -> dict | None:
    """The tuned GEMV config {"BLOCK_N", "BLOCK_K", "num_warps"} for a weight [n, k] on this
    arch, or None where cuBLAS serves (no row: untuned, or cuBLAS was as fast).
    DSC_GEMV (switches.py): "tuned" (default), "off" (cuBLAS everywhere), "all" (the GEMV at
    every shape, untuned ones with `default_gemv_config`: for checking the kernel inside small
    models). `mode` overrides DSC_GEMV (the planner plans "tuned": what runs on the target
    unless someone sets the variable there)."""
    mode = mode or switches.GEMV
    if mode == "off":
        return None
    row = tuning_table().get(arch, {}).get("gemv", {}).get(f"N{n}_K{k}")
    if not row:
        return default_gemv_config(k) if mode == "all" else None
    return {key: row[key] for key in CONFIG_KEYS if key in row}


def gemv_swiglu_config(n: int, k: int, arch: str, mode: str | None = None) -> dict | None:
    """The fused GEMV + swiglu kernel's config for a gate_up weight [n, k] (n / 2 outputs), or
    None where the shape's GEMV is not in use (`gemv_config`: no tuned row, DSC_GEMV=off), which
    leaves cuBLAS and the swiglu kernel. From the GEMV row: a program reads the BLOCK_N gate rows
    and the BLOCK_N up rows of its outputs, so half the GEMV's BLOCK_N (at least 1) keeps its
    tuned [rows, BLOCK_K] tile and grid; where the GEMV streams one row per program (Llama's
    gate_up shapes) the tile is 2 rows, and there are half as many programs. kernels/tuning.json's
    `gemv_swiglu` row (BLOCK_N counting outputs) overrides that where one was measured."""
    cfg = gemv_config(n, k, arch, mode)
    if cfg is None or n % 2:
        return None
    row = tuning_table().get(arch, {}).get("gemv_swiglu", {}).get(f"N{n}_K{k}") or {}
    return {**cfg, "BLOCK_N": max(1, cfg["BLOCK_N"] // 2), **{key: row[key] for key in CONFIG_KEYS if key in row}}


def default_gemv_config(k: int) -> dict:
    """4 rows per program, K-blocks of up to 512, about 8 elements (16 bytes) per thread."""
    block_k = min(512, next_power_of_2(k))
    return {"BLOCK_N": 4, "BLOCK_K": block_k, "num_warps": max(1, min(4, 4 * block_k // 256))}


def _check_one_row(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError unless x is one row of weight's dtype and weight [N, K] is contiguous."""
    n, k = weight.shape
    if x.numel() != k or x.dtype != weight.dtype:
        raise ValueError(
            f"{op}: x {x.dtype}{list(x.shape)} does not match one row of weight {weight.dtype}{list(weight.shape)}"
        )
    if weight.stride(1) != 1 or weight.stride(0) != k:
        raise ValueError(f"{op}: the weight must be contiguous [N, K]")


def _is_one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """What the GEMV kernels take: x one row of weight's dtype, weight contiguous."""
    return x.numel() == weight.shape[1] and x.dtype == weight.dtype and weight.is_contiguous()


def early_columns(blocks: int, block_k: int, k: int) -> int:
    """The EARLY_K constexpr (columns) of `blocks` K-blocks of block_k columns: 0 (no peeled tile: the loop's
    first K-block loads before the wait) for one block or fewer; else blocks * block_k rounded
    down to a power of two (a tile) and to at most k."""
    if blocks <= 1:
        return 0
    cols = block_k * (1 << (blocks.bit_length() - 1))
    while cols > k and cols > block_k:
        cols //= 2
    return cols if cols > block_k else 0


def gemv_launch(config: dict, n: int, k: int, device: torch.device) -> tuple[tuple[int], dict]:
    """(grid, launch keywords) of a kernel built on `_gemv_rows` with `config`'s BLOCK_N outputs
    per program, over n outputs and K = k: X_ROW off unless the config sets it, EVEN, PDL, and
    EARLY_K, the columns of the config's EARLY K-blocks (`early_columns`)."""
    cfg = {"X_ROW": False, **config}
    even = n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0
    cfg["EARLY_K"] = early_columns(cfg.pop("EARLY", 1), cfg["BLOCK_K"], k)
    return (cdiv(n, cfg["BLOCK_N"]),), {**cfg, "EVEN": even, **pdl_options(device)}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """x [K] or [1, K] (any leading dims of one row) -> [..., N] with the GEMV kernel."""
    _check_one_row("gemv", x, weight)
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias must be {x.dtype}[{n}], got {bias.dtype}{list(bias.shape)}")
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    grid, opts = gemv_launch(config, n, k, x.device)
    jit(_gemv_kernel)[grid](
        x.contiguous(), weight, bias if bias is not None else weight, y, n, k, HAS_BIAS=bias is not None, **opts
    )
    return y


def gemv_swiglu(x: torch.Tensor, weight: torch.Tensor, config: dict) -> torch.Tensor:
    """x [K] or [1, K] (any leading dims of one row), weight [2N, K] = [gate; up] -> silu(gate x)
    * (up x) [..., N] with the fused kernel (`gemv_swiglu_config`: BLOCK_N counts outputs)."""
    _check_one_row("gemv_swiglu", x, weight)
    n2, k = weight.shape
    if n2 % 2:
        raise ValueError(f"gemv_swiglu: the weight [gate; up] must have an even number of rows, got {n2}")
    y = torch.empty(*x.shape[:-1], n2 // 2, device=x.device, dtype=x.dtype)
    grid, opts = gemv_launch(config, n2 // 2, k, x.device)
    jit(_gemv_swiglu_kernel)[grid](x.contiguous(), weight, y, n2 // 2, k, **opts)
    return y


# -- custom op -----------------------------------------------------------------------------------
@torch.library.custom_op("dsc::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


declare("dsc.linear.default", bias_arg=2)


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@cuda_kernel(linear)
def _(x, weight, bias=None):
    cfg = gemv_config(*weight.shape, arch_of(x.device)) if _is_one_row(x, weight) else None
    return F.linear(x, weight, bias) if cfg is None else gemv(x, weight, bias, cfg)


def _swiglu_halves(y: torch.Tensor, swiglu) -> torch.Tensor:
    """swiglu(gate, up) of y [..., 2N] = [gate | up], the halves read in place: [..., N]."""
    n = y.shape[-1] // 2
    return swiglu(y[..., :n], y[..., n:])


def linear_swiglu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _swiglu_halves(F.linear(x, weight), swiglu_reference)


@torch.library.custom_op("dsc::linear_swiglu", mutates_args=())
def linear_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dsc::swiglu of the halves of dsc::linear(x, weight), weight [2N, K] = [gate; up] (no bias):
    the values of the two ops (the linear's output rounded to the dtype, then swiglu)."""
    return linear_swiglu_reference(x, weight)


declare("dsc.linear_swiglu.default", fuses=("dsc.linear.default", "dsc.swiglu.default"))


@linear_swiglu.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


@cuda_kernel(linear_swiglu)
def _(x, weight):
    cfg = gemv_swiglu_config(*weight.shape, arch_of(x.device)) if _is_one_row(x, weight) else None
    if cfg is None:  # the pair: cuBLAS (or the GEMV), then the swiglu kernel on the halves in place
        return _swiglu_halves(torch.ops.dsc.linear(x, weight), torch.ops.dsc.swiglu)
    return gemv_swiglu(x, weight, cfg)


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
    return {
        "name": "triton.gemv",
        "config": {"N": n, "K": k, "bias": has_bias, **cfg, "M>1": "cublas.gemm"},
        "launches": 1,
    }


@planner("dsc.linear_swiglu.default")
def _plan_linear_swiglu(x, weight, *, arch):
    """Counted at one row: the fused kernel where the gate_up shape's GEMV is tuned (1 launch),
    else the linear's kernel and the swiglu kernel."""
    n, k = weight.shape
    cfg = gemv_swiglu_config(n, k, arch, mode="tuned")
    if cfg is not None:
        return {
            "name": "triton.gemv_swiglu",
            "config": {"N": n, "K": k, **cfg, "M>1": "cublas.gemm + triton.swiglu"},
            "launches": 1,
        }
    lin = _plan_linear(x, weight, arch=arch)
    act = _plan_swiglu(torch.empty(n // 2, device="meta"), None, arch=arch)  # it reads the width
    return {
        "name": f"{lin['name']} + {act['name']}",
        "config": {**lin["config"], "swiglu": act["config"]},
        "launches": lin["launches"] + act["launches"],
    }
