"""FP8 linears: `dsc::linear_fp8` (e4m3 weights with one scale per output channel, e4m3
activations with one scale per token, an fp8 x fp8 -> fp32 matmul).

Storage (one weight [N, K] = [out, in] of one rank)
    qweight: [N, K] float8_e4m3fn   w / scale, rounded to nearest even, in [-448, 448]
    scale:   [N, 1] fp32            max|w| of the row / 448
Activations are quantized per token, dynamically: each row of x [M, K] gets scale max|x| / 448.
The product is y = (xq @ qweight^T) * xscale * scale^T (+ bias), accumulated in fp32.

CUDA: the activations are quantized by one Triton kernel (`_quantize_rows_fp8_kernel`: one
program per row, an amax pass and a convert pass), the matmul is `torch._scaled_mm` (cuBLASLt on
the FP8 tensor cores, row-wise scales in its epilogue, bf16 output). The plain-torch reference
is the CPU implementation and the test oracle; it rounds exactly as the GPU path does (the
scales are the same fp32 divisions, e4m3 conversion rounds to nearest even in both), so the two
differ only in the order of the fp32 sums.
"""

from __future__ import annotations

import torch

from dsc.kernels.launch import jit, next_power_of_2, planner
from dsc.kernels.registry import cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch
E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
INV_FP8_MAX = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))  # 1/448 as fp32 holds it
SCALE_MIN = torch.finfo(torch.float32).tiny  # scales stay normal floats: x / scale never divides by 0
QUANT_ROWS = 1 << 18  # elements quantized at a time on CPU


def _row_scales(amax: torch.Tensor) -> torch.Tensor:
    # amax times the fp32 reciprocal of 448: torch on CUDA divides by a scalar that way, on
    # CPU it divides; the product is the same on both, and in the Triton kernel
    return torch.where(amax > 0, amax * INV_FP8_MAX, torch.ones_like(amax)).clamp(min=SCALE_MIN)


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    # torch's cast is not saturating (a value past 448 becomes NaN): clamp first
    return v.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def quantize_weight(
    w: torch.Tensor, col_scale: torch.Tensor | None = None, out: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """w [N, K] float -> {"qweight": e4m3 [N, K], "scale": fp32 [N, 1]}, a block of rows at a
    time in fp32. `col_scale` is refused (fp8 has no SmoothQuant form); `out`: parts of these
    shapes to write into (the rows of a larger weight's parts)."""
    if col_scale is not None:
        raise ValueError("fp8 weights take no column scales")
    n, k = w.shape
    out = (
        out
        if out is not None
        else {
            "qweight": torch.empty(n, k, dtype=E4M3, device=w.device),
            "scale": torch.empty(n, 1, dtype=torch.float32, device=w.device),
        }
    )
    rows = n if w.device.type != "cpu" else max(1, min(n, QUANT_ROWS // max(k, 1)))
    for a in range(0, n, rows):
        f = w[a : a + rows].float()
        s = _row_scales(f.abs().amax(1, keepdim=True))
        out["scale"][a : a + rows] = s
        out["qweight"][a : a + rows] = _to_e4m3(f / s)
    return out


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32."""
    return qweight.float() * scale.float()


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3: x [M, K] -> (xq e4m3 [M, K], xscale fp32 [M, 1])."""
    v = x.float()
    xs = _row_scales(v.abs().amax(-1, keepdim=True))
    return _to_e4m3(v / xs), xs


def linear_fp8_reference(x, qweight, scale, bias):
    # x: [..., K] -> [..., N]; products of the e4m3 values summed in fp32, then both scales
    n, k = qweight.shape
    xq, xs = quantize_activation(x.reshape(-1, k))
    y = (xq.float() @ qweight.float().T) * xs * scale.float().reshape(1, n)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


@torch.library.custom_op("dsc::linear_fp8", mutates_args=())
def linear_fp8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear_fp8_reference(x, qweight, scale, bias)


declare("dsc.linear_fp8.default", quantized=True, bias_arg=3)


@linear_fp8.register_fake
def _(x, qweight, scale, bias):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@cuda_kernel(linear_fp8)
def _(x, qweight, scale, bias):
    k = x.shape[-1]
    y = fp8_matmul(x.reshape(-1, k), qweight, scale, bias)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


def _quantize_rows_fp8_kernel(X, Q, XS, K, stride_xm, INV_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per row: an amax pass, then a convert pass (the row is in L2 the second time)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(X + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    m = tl.max(amax, axis=0)
    # the reference's arithmetic: the scale is max|x| times fp32(1/448), the division rounded
    # (div_rn: Triton's `/` on fp32 is approximate), so values and scales equal it bit for bit
    scale = tl.maximum(tl.where(m > 0, m * INV_MAX, 1.0), 1.1754943508222875e-38)  # SCALE_MIN
    tl.store(XS + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(X + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
        tl.store(Q + row * K + offs, v.to(tl.float8e4nv), mask=offs < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of quantize_activation for x [M, K] on CUDA: (xq e4m3 [M, K], xscale fp32 [M, 1])."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    xq = torch.empty(m, k, device=x.device, dtype=E4M3)
    xs = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m:
        block = min(2048, next_power_of_2(k))
        jit(_quantize_rows_fp8_kernel)[(m,)](
            x, xq, xs, k, x.stride(0), INV_MAX=INV_FP8_MAX, BLOCK_K=block, num_warps=4 if block <= 1024 else 8
        )
    return xq, xs


def fp8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (16- or 32-bit) @ dequant(qweight [N, K])^T on the FP8 tensor cores -> [M, N] in
    x's dtype. cuBLASLt's row-wise scaling writes bf16 and takes K and N in multiples of 16."""
    n, k = qweight.shape
    if k % 16 or n % 16:  # outside what cuBLASLt takes: the reference's arithmetic, on the device
        return linear_fp8_reference(x, qweight, scale, bias)
    xq, xs = quantize_rows(x)
    b = None if bias is None else bias.to(torch.bfloat16)
    y = torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=scale.reshape(1, n), bias=b, out_dtype=torch.bfloat16)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


@planner("dsc.linear_fp8.default")
def _plan_fp8(x, qweight, scale, bias, *, arch):
    n, k = qweight.shape
    return {
        "name": "cublaslt.scaled_mm_fp8",
        "config": {"N": n, "K": k, "scales": "row-wise", "activations": "triton.quantize_rows_fp8"},
        "launches": 2,
    }
