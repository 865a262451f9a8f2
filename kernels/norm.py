"""Normalization with the residual add fused in: `dsc::rmsnorm`, `dsc::add_rmsnorm`,
`dsc::add_layernorm`.

    rmsnorm(x, weight, eps)                          -> y
    add_rmsnorm(x, residual, weight, eps)            -> (s, y)   s = x + residual, y = norm(s)
    add_layernorm(x, residual, weight, bias, eps[, x_bias]) -> (s, y)  s = (x + x_bias) + residual
    x, residual, s, y: [..., N]; weight, bias, x_bias: [N]; all one dtype. s and y are contiguous.
x_bias is the bias of the linear that produced x, which fuse_add_norm moves here (at batch 1
cuBLAS has no bias epilogue, so an unfused bias costs a launch); x + x_bias is rounded to the
dtype before the residual add, as the linear's biased output was.

One kernel reads x and residual once and writes s (the next residual) and y once: a row per
program, the whole row in registers (N <= 65536). Numerics follow Hugging Face's modules in
16-bit: the sum is rounded to the input dtype (as the unfused add), statistics are fp32, and
RMSNorm rounds the normalized row before the weight multiply (LlamaRMSNorm's `.to(dtype)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc.kernels.launch import arch_of, jit, next_power_of_2, pdl_options, planner, rows_of, tuned
from dsc.kernels.registry import cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch
MAX_N = 65536


# -- Triton kernels -------------------------------------------------------------------------
def _rmsnorm_kernel(
    X,
    R,
    W,
    S,
    Y,
    stride_x,
    stride_r,
    stride_s,
    stride_y,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # kernels/launch.py: let the next kernel start; wait for the previous one before any access
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # s = x + r, rounded like the unfused add
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32)  # HF: weight * normed.to(dtype)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * y).to(Y.dtype.element_ty), mask=mask)


def _layernorm_kernel(
    X,
    R,
    W,
    B,
    XB,
    S,
    Y,
    stride_x,
    stride_r,
    stride_s,
    stride_y,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_XBIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # kernels/launch.py: let the next kernel start; wait for the previous one before any access
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_XBIAS:
        xb = tl.load(XB + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + xb.to(tl.float32)).to(x.dtype)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=0) / N
    d = tl.where(mask, xf - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
    y = d * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


# -- configs ----------------------------------------------------------------------------------
def norm_config(kernel: str, n: int, arch: str) -> dict:
    """{"BLOCK_N", "num_warps"} for a row of n elements: one row per program."""
    block = next_power_of_2(n)
    default = {"num_warps": 4 if block <= 1024 else 8 if block <= 4096 else 16}
    return {"BLOCK_N": block, **tuned(kernel, f"N{block}", arch, default)}


# -- wrappers ---------------------------------------------------------------------------------
def _check(x, residual, weight, bias, x_bias=None):
    n = x.shape[-1]
    if n > MAX_N:
        raise ValueError(f"norm kernels hold a row in registers: N={n} > {MAX_N}")
    if (
        weight.shape != (n,)
        or (bias is not None and bias.shape != (n,))
        or (x_bias is not None and x_bias.shape != (n,))
    ):
        raise ValueError(f"norm: weight/bias must be [{n}], got {list(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"norm: residual {residual.dtype}{list(residual.shape)} != x {x.dtype}{list(x.shape)}")


def add_norm_triton(kind: str, x, residual, weight, bias, eps: float, config: dict | None = None, x_bias=None):
    """Launch the rmsnorm ("rms") or layernorm ("layer") kernel: returns (s or None, y)."""
    _check(x, residual, weight, bias, x_bias)
    if x_bias is not None and kind == "rms":
        raise ValueError("norm: x_bias is supported with layernorm only")
    n = x.shape[-1]
    x, rows, sx = rows_of(x)
    r, _, sr = rows_of(residual) if residual is not None else (x, rows, sx)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    name = "add_rmsnorm" if kind == "rms" else "add_layernorm"
    cfg = dict(config or norm_config(name, n, arch_of(x.device)))
    if rows:
        num_warps = cfg.pop("num_warps")
        common = dict(HAS_RESIDUAL=residual is not None, num_warps=num_warps, **cfg, **pdl_options(x.device))
        if kind == "rms":
            jit(_rmsnorm_kernel)[(rows,)](x, r, weight.contiguous(), s, y, sx, sr, n, n, n, eps, **common)
        else:
            b = bias.contiguous() if bias is not None else weight
            xb = x_bias.contiguous() if x_bias is not None else weight
            jit(_layernorm_kernel)[(rows,)](
                x,
                r,
                weight.contiguous(),
                b,
                xb,
                s,
                y,
                sx,
                sr,
                n,
                n,
                n,
                eps,
                HAS_BIAS=bias is not None,
                HAS_XBIAS=x_bias is not None,
                **common,
            )
    return (s if residual is not None else None), y


# -- references (the CPU implementation and the test oracle) ----------------------------------
def rmsnorm_reference(x, weight, eps):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rmsnorm_reference(x, residual, weight, eps):
    s = x + residual
    return s, rmsnorm_reference(s, weight, eps)


def add_layernorm_reference(x, residual, weight, bias, eps, x_bias=None):
    s = (x if x_bias is None else x + x_bias) + residual
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


# -- custom ops -------------------------------------------------------------------------------
@torch.library.custom_op("dsc::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rmsnorm_reference(x, weight, eps)


declare("dsc.rmsnorm.default")


@cuda_kernel(rmsnorm)
def _(x, weight, eps):
    return add_norm_triton("rms", x, None, weight, None, eps)[1]


@rmsnorm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("dsc::add_rmsnorm", mutates_args=())
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rmsnorm_reference(x, residual, weight, eps)


declare("dsc.add_rmsnorm.default")


@cuda_kernel(add_rmsnorm)
def _(x, residual, weight, eps):
    return add_norm_triton("rms", x, residual, weight, None, eps)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("dsc::add_layernorm", mutates_args=())
def add_layernorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    x_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return add_layernorm_reference(x, residual, weight, bias, eps, x_bias)


declare("dsc.add_layernorm.default")


@cuda_kernel(add_layernorm)
def _(x, residual, weight, bias, eps, x_bias=None):
    return add_norm_triton("layer", x, residual, weight, bias, eps, x_bias=x_bias)


@add_layernorm.register_fake
def _(x, residual, weight, bias, eps, x_bias=None):
    return x.new_empty(x.shape), x.new_empty(x.shape)


# -- planners (plan_kernels) ------------------------------------------------------------------
@planner("dsc.rmsnorm.default")
def _plan_rmsnorm(x, weight, eps, *, arch):
    return {"name": "triton.rmsnorm", "config": norm_config("add_rmsnorm", x.shape[-1], arch), "launches": 1}


@planner("dsc.add_rmsnorm.default")
def _plan_add_rmsnorm(x, residual, weight, eps, *, arch):
    return {"name": "triton.add_rmsnorm", "config": norm_config("add_rmsnorm", x.shape[-1], arch), "launches": 1}


@planner("dsc.add_layernorm.default")
def _plan_add_layernorm(x, residual, weight, bias, eps, x_bias=None, *, arch):
    cfg = norm_config("add_layernorm", x.shape[-1], arch)
    return {
        "name": "triton.add_layernorm",
        "config": {**cfg, **({"x_bias": True} if x_bias is not None else {})},
        "launches": 1,
    }
