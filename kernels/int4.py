"""Int4 linears: `dsc::linear_w4a16` (4-bit weights in groups along the input features, 16-bit
activations).

Storage (one weight [N, K] = [out, in] of one rank; `G = K // group_size` groups per row)
    qweight: [N, K // 2] uint8   two 4-bit values q in [0, 15] per byte: input feature 2j in the
                                 low nibble, 2j + 1 in the high one
    scale:   [N, G] fp16         w ~= q * scale + min, per row and group
    min:     [N, G] fp16
Rounding to nearest from a 16-bit checkpoint: per group, min = min(w), scale = (max(w) -
min(w)) / 15 (both rounded to fp16 first, then q = round((w - min) / scale) clamped to [0, 15]).
GGUF's Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m) blocks of 32 are this layout at group
size 32 exactly: scale d, min -8d or m.

Kernels (CUDA, Triton via kernels/launch.py)
    _w4a16_gemv_kernel  M == 1 (decode): each program streams BLOCK_N rows of packed weights, a
                        K-block of one scale group at a time; per group and row y += scale *
                        sum(q x) + min * sum(x), in fp32. No tensor cores: at one row the matmul
                        is a read of the weight (a quarter of its 16-bit bytes).
    _w4a16_mma_kernel   2-16 rows: the K-block's nibbles dequantized to x's dtype in registers,
                        the even and odd input features as two tensor-core dots per K-block.
    above MMA_ROWS rows (prefill) the weight is dequantized to x's dtype (torch ops) and
    multiplied by cuBLAS: the mma kernel re-dequantizes every weight tile for each block of
    rows, which at thousands of rows costs far more than one dequantized copy.
The plain-torch reference is the CPU implementation and the test oracle: it dequantizes the
weight to x's dtype and multiplies (the kernels sum in fp32 in another order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc.kernels.launch import cdiv, jit, planner
from dsc.kernels.registry import cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch
DEFAULT_GROUP = 128
MMA_ROWS = 16  # the mma kernel's largest row count; more rows: dequantize, then cuBLAS
GROUP_MULTIPLE = 32  # group sizes are multiples of this: the mma kernel's K-block (16 bytes of nibbles per row)
QUANT_ROWS = 1 << 18  # elements quantized at a time on CPU


def _groups(k: int, group_size: int) -> int:
    if k % group_size or group_size % 2:
        raise ValueError(f"group size {group_size} does not divide the {k} input features into even groups")
    return k // group_size


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in [0, 15] -> [N, K // 2] uint8 (even features in the low nibble)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> q [N, K] uint8."""
    n, half = qweight.shape
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(n, 2 * half)


def quantize_weight(
    w: torch.Tensor, group_size: int = DEFAULT_GROUP, out: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """w [N, K] float -> {"qweight": uint8 [N, K // 2], "scale": fp16 [N, G], "min": fp16 [N, G]},
    rounding to nearest, a block of rows at a time in fp32. `out`: parts of these shapes to write
    into (the rows of a larger weight's parts)."""
    n, k = w.shape
    g = _groups(k, group_size)
    out = (
        out
        if out is not None
        else {
            "qweight": torch.empty(n, k // 2, dtype=torch.uint8, device=w.device),
            "scale": torch.empty(n, g, dtype=torch.float16, device=w.device),
            "min": torch.empty(n, g, dtype=torch.float16, device=w.device),
        }
    )
    rows = n if w.device.type != "cpu" else max(1, min(n, QUANT_ROWS // max(k, 1)))
    for a in range(0, n, rows):
        f = w[a : a + rows].float().reshape(-1, g, group_size)  # [rows, G, group]
        lo, hi = f.amin(-1), f.amax(-1)
        span = hi - lo
        s = torch.where(span > 0, span / 15, torch.ones_like(span)).half()
        m = lo.half()
        s32 = torch.where(s.float() > 0, s.float(), torch.ones_like(span))  # fp16 underflow: any scale (q is 0)
        q = torch.round((f - m.float()[..., None]) / s32[..., None]).clamp(0, 15)
        out["qweight"][a : a + rows] = pack(q.reshape(-1, k))
        out["scale"][a : a + rows], out["min"][a : a + rows] = s, m
    return out


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32."""
    q = unpack(qweight).float()
    n, k = q.shape
    g = scale.shape[1]
    return (q.reshape(n, g, k // g) * scale.float()[..., None] + minv.float()[..., None]).reshape(n, k)


def quantization_error(w: torch.Tensor, parts: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(|w|^2, |w - dequant(parts)|^2), summed a block of rows at a time."""
    n, k = w.shape
    rows = max(1, min(n, QUANT_ROWS // max(k, 1)))
    signal = noise = 0.0
    for a in range(0, n, rows):
        f = w[a : a + rows].float()
        d = (
            dequantize_weight(parts["qweight"][a : a + rows], parts["scale"][a : a + rows], parts["min"][a : a + rows])
            - f
        )
        signal += float(torch.dot(f.view(-1), f.view(-1)))
        noise += float(torch.dot(d.view(-1), d.view(-1)))
    return signal, noise


def linear_w4a16_reference(x, qweight, scale, minv, bias, group_size):
    # x: [..., K] -> [..., N]; the weight dequantized to x's dtype
    w = dequantize_weight(qweight, scale, minv).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@torch.library.custom_op("dsc::linear_w4a16", mutates_args=())
def linear_w4a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    minv: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    return linear_w4a16_reference(x, qweight, scale, minv, bias, group_size)


declare("dsc.linear_w4a16.default", quantized=True, bias_arg=4)


@linear_w4a16.register_fake
def _(x, qweight, scale, minv, bias, group_size):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@cuda_kernel(linear_w4a16)
def _(x, qweight, scale, minv, bias, group_size):
    k = x.shape[-1]
    y = w4a16_matmul(x.reshape(-1, k), qweight, scale, minv, bias, group_size)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


# -- kernels ---------------------------------------------------------------------------------


def _w4a16_gemv_kernel(
    X,
    W,
    S,
    MN,
    B,
    Y,
    N,
    K,
    G,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # y[n] = sum_g scale[n, g] * sum_{k in g} q[n, k] x[k] + min[n, g] * sum_{k in g} x[k]
    # BLOCK_K divides GROUP: each K-block lies in one group
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    half = tl.arange(0, BLOCK_K // 2)
    rows = offs_n.to(tl.int64) * (K // 2)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        packed = tl.load(
            W + rows[:, None] + (k0 // 2 + half)[None, :], mask=mask_n[:, None], other=0, eviction_policy="evict_first"
        )  # [BLOCK_N, BLOCK_K // 2] uint8
        lo = (packed & 15).to(tl.float32)
        hi = (packed >> 4).to(tl.float32)
        xe = tl.load(X + k0 + 2 * half).to(tl.float32)
        xo = tl.load(X + k0 + 2 * half + 1).to(tl.float32)
        g = k0 // GROUP
        s = tl.load(S + offs_n * G + g, mask=mask_n, other=0.0).to(tl.float32)
        m = tl.load(MN + offs_n * G + g, mask=mask_n, other=0.0).to(tl.float32)
        y += s * tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1) + m * tl.sum(xe + xo, axis=0)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


def _w4a16_mma_kernel(
    X,
    W,
    S,
    MN,
    B,
    Y,
    M,
    N,
    K,
    G,
    stride_xm,
    stride_ym,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # y [M, N] = x [M, K] @ dequant(w)^T: per K-block (in one group) the even and odd features'
    # [BLOCK_N, BLOCK_K // 2] weight halves dequantized to x's dtype, two dots
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    half = tl.arange(0, BLOCK_K // 2)
    rows = offs_n.to(tl.int64) * (K // 2)
    xrow = offs_m.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        packed = tl.load(W + rows[:, None] + (k0 // 2 + half)[None, :], mask=mask_n[:, None], other=0)
        g = k0 // GROUP
        s = tl.load(S + offs_n * G + g, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        m = tl.load(MN + offs_n * G + g, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        w_lo = ((packed & 15).to(tl.float32) * s + m).to(X.dtype.element_ty)
        w_hi = ((packed >> 4).to(tl.float32) * s + m).to(X.dtype.element_ty)
        xe = tl.load(X + xrow[:, None] + (k0 + 2 * half)[None, :], mask=mask_m[:, None], other=0.0)
        xo = tl.load(X + xrow[:, None] + (k0 + 2 * half + 1)[None, :], mask=mask_m[:, None], other=0.0)
        acc = tl.dot(xe, tl.trans(w_lo), acc, input_precision=PRECISION)
        acc = tl.dot(xo, tl.trans(w_hi), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w4a16_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Launch configuration: the GEMV at one row (the fastest of scripts/bench_int4.py's sweep at
    Llama-8B's shapes on an H200: 16 rows per program for the widest weights, else 4), the mma
    kernel to MMA_ROWS rows, "dequantize" (then cuBLAS) above."""
    block_k = min(group_size, 128)
    if m == 1:
        return {"kernel": "w4a16_gemv", "BLOCK_N": 16 if n >= 16384 else 4, "BLOCK_K": block_k, "num_warps": 2}
    if m > MMA_ROWS:
        return {"kernel": "dequantize"}
    return {
        "kernel": "w4a16_mma",
        "BLOCK_M": 16,
        "BLOCK_N": 64,
        "BLOCK_K": max(GROUP_MULTIPLE, min(block_k, 64)),
        "num_warps": 4,
        "num_stages": 3,
    }


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    minv: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] fp16/bf16/fp32 -> [M, N] in x's dtype, by the Triton kernels."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] * 2 != k or scale.shape != (n, k // group_size) or group_size % GROUP_MULTIPLE:
        raise ValueError(
            f"w4a16: x [{m}, {k}], qweight {list(qweight.shape)}, scale {list(scale.shape)}, "
            f"group size {group_size}: shapes do not fit"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    cfg = dict(config or w4a16_config(m, n, k, group_size))
    kernel = cfg.pop("kernel")
    if kernel == "dequantize":
        return linear_w4a16_reference(x, qweight, scale, minv, bias, group_size)
    opts = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
    bias_ = bias if bias is not None else scale
    g = k // group_size
    if kernel == "w4a16_gemv":
        jit(_w4a16_gemv_kernel)[(cdiv(n, cfg["BLOCK_N"]),)](
            x, qweight, scale, minv, bias_, y, n, k, g, GROUP=group_size, HAS_BIAS=bias is not None, **cfg, **opts
        )
        return y
    grid = (cdiv(n, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]))
    jit(_w4a16_mma_kernel)[grid](
        x,
        qweight,
        scale,
        minv,
        bias_,
        y,
        m,
        n,
        k,
        g,
        x.stride(0),
        y.stride(0),
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **cfg,
        **opts,
    )
    return y


_PLAN_BUCKETS = (1, 8, 64, 256)


@planner("dsc.linear_w4a16.default")
def _plan_w4a16(x, qweight, scale, minv, bias, group_size, *, arch):
    n, k = qweight.shape[0], qweight.shape[1] * 2
    cfg = {f"M{b}": w4a16_config(b, n, k, group_size) for b in _PLAN_BUCKETS}
    return {"name": "triton.w4a16", "config": cfg, "launches": 1}
