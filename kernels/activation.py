"""Activation epilogues as one elementwise kernel each: `dsc::swiglu`, `dsc::gelu`.

    swiglu(gate, up)         -> silu(gate) * up      gate, up: [..., N] (strided views of one
                                                      fused gate_up output are read in place)
    gelu(x, approximate[, bias]) -> GELU(x + bias), "none" (erf) or "tanh"   x: [..., N], bias: [N]
                                (the bias of the linear before it, which fuse_activation moves
                                here: at batch 1 cuBLAS has no bias epilogue, so an unfused
                                bias costs a launch)
Outputs are contiguous. A program covers BLOCK columns of one row; every input byte is read
once and every output byte written once. Numerics: fp32 inside; swiglu rounds silu(gate) to
the input dtype before the multiply, as the unfused `act_fn(gate) * up` does in 16-bit; gelu
rounds x + bias to the input dtype first, as the linear's output was.

Exact gelu without erf: x Phi(x) with the normal tail Phi(-|x|) = 2^P(|x|), P a degree-10
polynomial (10 FMAs and one ex2 per element; libdevice's erff, about 3x that with both of its
branches, made the kernel issue-bound at 64% of an H200's bandwidth).  P was fitted to
log2 Phi(-s) on s in [0, 8] (weighted minimax, Lawson iterations, fp32 coefficients): the
implied erf has max |error| 1.4e-7 against float64 erf (fp32 arithmetic with exact exp2; the
GPU's ex2.approx adds up to 2 ulp of h: <= 3.6e-7), and Phi(-s) keeps 4e-4 relative accuracy
down to s = 8 (the negative tail torch's 1 + erf loses to cancellation); past s = 8, P falls
faster than log2 Phi(-s), to -inf without NaN, so gelu(x) -> -0.  tests/test_fused_kernels.py
checks this on a dense grid in the interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc.kernels.launch import arch_of, cdiv, device, jit, next_power_of_2, pdl_options, planner, rows_of, tuned
from dsc.kernels.registry import cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch


# -- Triton kernels -------------------------------------------------------------------------
@device
def _silu_mul(g, u, DT: tl.constexpr):
    # silu(g) * u as dtype DT, from g and u in fp32: silu rounded to DT before the multiply, as
    # the unfused `act_fn(gate) * up` rounds it in 16-bit. Shared by the swiglu kernel and the
    # GEMV that computes gate and up itself (kernels/linear.py)
    a = (g * tl.sigmoid(g)).to(DT).to(tl.float32)
    return (a * u).to(DT)


def _swiglu_kernel(G, U, Y, stride_g, stride_u, stride_y, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # kernels/launch.py: let the next kernel start; wait for the previous one before any access
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, _silu_mul(g, u, Y.dtype.element_ty), mask=mask)


def _gelu_kernel(
    X,
    B,
    Y,
    stride_x,
    stride_y,
    N,
    APPROX_TANH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # kernels/launch.py: let the next kernel start; wait for the previous one before any access
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:  # x + bias, rounded as the linear's biased output
        x = (x + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)).to(Y.dtype.element_ty).to(tl.float32)
    if APPROX_TANH:  # tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (2.0 * tl.sigmoid(2.0 * z))
    else:  # x Phi(x): Phi(x) = 1 - h for x >= 0, h for x < 0, where h = Phi(-|x|) = 2^P(|x|)
        s = tl.abs(x)
        p = tl.fma(tl.fma(tl.fma(-1.93835472e-08, s, 6.54096254e-07), s, -9.18926798e-06), s, 6.83566104e-05)
        p = tl.fma(
            tl.fma(tl.fma(tl.fma(p, s, -2.58120766e-04), s, -3.51600684e-05), s, 6.9823293e-03), s, -5.24622686e-02
        )
        h = tl.exp2(tl.fma(tl.fma(tl.fma(p, s, -4.59214419e-01), s, -1.15110493), s, -1.0))
        y = x * tl.where(x >= 0, 1.0 - h, h)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


# -- configs ----------------------------------------------------------------------------------
def elementwise_config(kernel: str, n: int, arch: str) -> dict:
    """{"BLOCK", "num_warps"}: programs of BLOCK columns over a [rows, n] grid."""
    width = next_power_of_2(n)
    default = {"BLOCK": min(1024, width), "num_warps": 4}
    return tuned(kernel, f"N{width}", arch, default)


def _launch(
    kernel,
    kname: str,
    ins: list[torch.Tensor],
    n: int,
    config: dict | None,
    vectors: tuple[torch.Tensor, ...] = (),
    **const,
):
    """ins: [..., n] tensors (row-strided); vectors: [n] tensors passed after them."""
    rows_ins = [rows_of(t) for t in ins]
    rows = rows_ins[0][1]
    y = torch.empty(ins[0].shape, dtype=ins[0].dtype, device=ins[0].device)
    cfg = dict(config or elementwise_config(kname, n, arch_of(y.device)))
    if rows and n:
        num_warps = cfg.pop("num_warps")
        grid = (rows, cdiv(n, cfg["BLOCK"]))
        jit(kernel)[grid](
            *(t for t, _, _ in rows_ins),
            *vectors,
            y,
            *(st for _, _, st in rows_ins),
            n,
            n,
            num_warps=num_warps,
            **cfg,
            **const,
            **pdl_options(y.device),
        )
    return y


# -- wrappers ---------------------------------------------------------------------------------
def swiglu_triton(gate, up, config: dict | None = None):
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {gate.dtype}{list(gate.shape)} != up {up.dtype}{list(up.shape)}")
    return _launch(_swiglu_kernel, "swiglu", [gate, up], gate.shape[-1], config)


def gelu_triton(x, approximate: str = "none", bias=None, config: dict | None = None):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if bias is not None and (bias.shape != (x.shape[-1],) or bias.dtype != x.dtype):
        raise ValueError(f"gelu: bias must be {x.dtype}[{x.shape[-1]}], got {bias.dtype}{list(bias.shape)}")
    vec = bias.contiguous() if bias is not None else x
    return _launch(
        _gelu_kernel,
        "gelu",
        [x],
        x.shape[-1],
        config,
        vectors=(vec,),
        APPROX_TANH=approximate == "tanh",
        HAS_BIAS=bias is not None,
    )


# -- references -------------------------------------------------------------------------------
def swiglu_reference(gate, up):
    return F.silu(gate) * up


def gelu_reference(x, approximate="none", bias=None):
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


# -- custom ops -------------------------------------------------------------------------------
@torch.library.custom_op("dsc::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_reference(gate, up)


declare("dsc.swiglu.default")


@cuda_kernel(swiglu)
def _(gate, up):
    return swiglu_triton(gate, up)


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("dsc::gelu", mutates_args=())
def gelu(x: torch.Tensor, approximate: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gelu_reference(x, approximate, bias)


declare("dsc.gelu.default")


@cuda_kernel(gelu)
def _(x, approximate, bias=None):
    return gelu_triton(x, approximate, bias)


@gelu.register_fake
def _(x, approximate, bias=None):
    return x.new_empty(x.shape)


# -- planners ---------------------------------------------------------------------------------
@planner("dsc.swiglu.default")
def _plan_swiglu(gate, up, *, arch):
    return {"name": "triton.swiglu", "config": elementwise_config("swiglu", gate.shape[-1], arch), "launches": 1}


@planner("dsc.gelu.default")
def _plan_gelu(x, approximate, bias=None, *, arch):
    cfg = {**elementwise_config("gelu", x.shape[-1], arch), "approximate": approximate}
    return {"name": "triton.gelu", "config": {**cfg, **({"bias": True} if bias is not None else {})}, "launches": 1}
