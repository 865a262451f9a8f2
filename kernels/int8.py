"""Int8 linears: `dsc::linear_w8a16` (int8 weights, 16-bit activations) and `dsc::linear_w8a8`
(int8 weights and per-token int8 activations, int8 x int8 -> int32 matmuls).

Storage (one weight [N, K] = [out, in] of one rank; `G = K // group_size` groups per row)
    qweight: [N, K] int8     symmetric: round(w / scale) in [-127, 127]
                             asymmetric: round(w / scale) + zero in [-128, 127]
    scale:   [N, G] fp32     w ~= (qweight - zero) * scale, per row and group of `group_size`
    zero:    [N, G] int8     zero points (asymmetric only; the ops take None when symmetric)
Per-channel quantization is one group per row: group_size == K, G == 1.

Activations (W8A8) are quantized per token (ZeroQuant-style, symmetric, dynamic): each row of
x [M, K] gets scale max|x| / 127. SmoothQuant migrates activation outliers into the weights
offline: the compiler multiplies weight column k by s_k and the op multiplies x[:, k] by
`inv_smooth[k]` = 1 / s_k before quantizing it, inside the activation-quantization kernel
(no separate multiply, and every linear may have its own s).

Kernels (CUDA, Triton via kernels/launch.py: triton is imported on the first launch)
    _w8a16_gemv_kernel  M == 1 decode: each program streams BLOCK_N rows of qweight with
                        16-byte loads, multiplies and accumulates in fp32 registers; one
                        reduction at the end. No tensor cores: at M == 1 the matmul is a pure
                        read of the weight, and the grid of N / BLOCK_N programs (N >= 4096 in
                        practice) is enough to keep every SM's loads in flight.
    _w8a16_mma_kernel   M > 1: tiles of x [BLOCK_M, BLOCK_K] times dequantized int8 tiles
                        [BLOCK_K, BLOCK_N] on tensor cores. Small BLOCK_M (16) for decode
                        batches, so the weight (the bytes that matter) is read once per
                        N-tile; larger tiles for prefill. Scales are applied once per row
                        (per-channel) or once per K-block (grouped, BLOCK_K | group_size).
                        Decode variants (config keys): SWAP_AB computes y^T = dequant(w) x^T,
                        the weight tile [BLOCK_N, BLOCK_K] as the MMA's A operand (kept in
                        registers) and x^T through shared memory; SPLIT_K > 1 gives each of
                        SPLIT_K programs (grid axis 2) a share of the K-blocks, fp32 partials,
                        and the tile's last split to finish (a per-tile counter) sums them and
                        writes y, in the same launch.
    _w8a16_regs_kernel  2-16 tokens on CUDA (configs with "REGS": true), written in Gluon:
                        the weight loaded from global memory straight into mma.sync's
                        A-operand registers (16 bytes per thread and row), x^T into the B
                        operand's, no shared memory in the K loop; WARPS_K parts of the K range
                        on separate warps, summed at the end; split-K as above; EARLY loads
                        the first K-block's weights before the PDL wait. Not runnable in
                        the interpreter (tests/gpu/test_gpu_int8.py checks it on a GPU).
    _quantize_rows_kernel  per-token activation quantization (x * inv_smooth, amax, round).
    _w8a8_kernel        int8 tensor-core GEMM, int32 accumulation; the epilogue applies
                        weight and token scales (per K-block for grouped scales).
Launch configurations (`int8_config`) come from kernels/tuning.json per (kernel, shape class
M<bucket>_N<n>_K<k>[_G<group>]) over built-in defaults (a REGS row stands alone; on sm_90 at
2-8 tokens the default is `regs_default(n, k)`); a row's keys are the kernel's constexprs and
launch options. scripts/bench_int8.py sweeps candidates on a GPU and prints the
rows to add. `plan_kernels` records them in plan.json.

The plain-torch references are the CPU implementation and the test oracle. Rounding is
round-half-to-even everywhere (torch.round), also in the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsc.kernels.activation import _silu_mul, swiglu_reference
from dsc.kernels.launch import (
    arch_of,
    cdiv,
    device,
    gluon_device,
    gluon_jit,
    jit,
    next_power_of_2,
    pdl_options,
    planner,
    split_counters,
    tuning_row,
)
from dsc.kernels.registry import KEEP, cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch
gl = mma_v2 = None  # gluon's language and its mma.sync, bound by launch.gluon_jit on first launch
SCALE_MIN = torch.finfo(torch.float32).tiny  # scales stay normal floats: x / scale never divides by 0

# -- quantization (offline weights, dynamic activations) ----------------------------------


def _groups(k: int, group_size: int | None) -> int:
    if not group_size:
        return 1
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the {k} input features")
    return k // group_size


def _group_qparams(wg: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """wg [N, G, group] fp32 -> (scale fp32 [N, G], zero fp32 [N, G]); max|w| is taken as
    max(max w, -min w), which is exact and needs no |w| temporary."""
    wmin, wmax = wg.amin(-1), wg.amax(-1)
    if symmetric:
        amax = torch.maximum(wmax, wmin.neg())  # [N, G]
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).clamp(min=SCALE_MIN)
        return scale, torch.zeros_like(scale)
    wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)
    span = wmax - wmin
    scale = torch.where(span > 0, span / 255, torch.ones_like(span)).clamp(min=SCALE_MIN)
    return scale, (-128 - torch.round(wmin / scale)).clamp(-128, 127)


def weight_qparams(
    w: torch.Tensor, group_size: int | None = None, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (scale fp32 [N, G], zero fp32 [N, G]) of quantize_weight.

    Symmetric: scale = max|w| / 127 per row and group, zero = 0. Asymmetric: the group's range
    [min(w, 0), max(w, 0)] maps onto [-128, 127] (0 stays exactly representable, so the zero
    point fits int8)."""
    w = w.float()
    n, k = w.shape
    g = _groups(k, group_size)
    return _group_qparams(w.reshape(n, g, k // g), symmetric)  # [N, G, group]


QUANT_CHUNK = 1 << 18  # elements quantized at a time on CPU: one fp32 scratch block that stays in cache


def quantize_weight(
    w: torch.Tensor,
    group_size: int | None = None,
    symmetric: bool = True,
    params: tuple[torch.Tensor, torch.Tensor] | None = None,
    col_scale: torch.Tensor | None = None,
    out: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """w [N, K] float (any float dtype) -> {"qweight": int8 [N, K], "scale": fp32 [N, G], "zero": int8 [N, G]}.

    Scales and zero points from `weight_qparams`, or `params` where given: those of a larger
    tensor whose columns w is a slice of (a row-parallel shard quantized with its whole rows'
    scales), so every entry is quantized as the whole tensor quantizes it. `col_scale` [K]
    (SmoothQuant) multiplies w's columns, in fp32, first. Round-trip error is at most
    scale / 2 per element. On CPU the rows are quantized a block at a time in one fp32 scratch
    buffer, in place (each element's arithmetic is the same as on the whole tensor). `out`:
    parts of these shapes to write into (the rows of a larger weight's parts)."""
    n, k = w.shape
    if params is not None and (params[0].shape[0] != n or k % params[0].shape[1]):
        raise ValueError(f"quantize_weight: params of shape {list(params[0].shape)} for a [{n}, {k}] weight")
    g = params[0].shape[1] if params is not None else _groups(k, group_size)
    lo, hi = (-127, 127) if symmetric else (-128, 127)
    if out is None:
        out = {
            "qweight": torch.empty(n, k, dtype=torch.int8, device=w.device),
            "scale": torch.empty(n, g, dtype=torch.float32, device=w.device),
            "zero": torch.empty(n, g, dtype=torch.int8, device=w.device),
        }
    q, scale, zero = out["qweight"], out["scale"], out["zero"]
    rows = n if w.device.type != "cpu" else max(1, min(n, QUANT_CHUNK // max(k, 1)))
    buf = torch.empty(rows * k, dtype=torch.float32, device=w.device)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        f = buf[: (b - a) * k].view(b - a, k)
        f.copy_(w[a:b])
        if col_scale is not None:
            f.mul_(col_scale)
        fg = f.view(b - a, g, k // g)  # [rows, G, group]
        s, z = _group_qparams(fg, symmetric) if params is None else (params[0][a:b], params[1][a:b])
        fg.div_(s[..., None]).round_()
        if not symmetric:
            fg.add_(z[..., None])
        f.clamp_(lo, hi)
        q[a:b].copy_(f)
        scale[a:b], zero[a:b] = s, z  # zero points: integer-valued, exact in int8
    return out


def quantization_error(
    w: torch.Tensor, parts: dict[str, torch.Tensor], col_scale: torch.Tensor | None = None, zero: bool = True
) -> tuple[float, float]:
    """(|w|^2, |w - dequant(parts)|^2) of quantize_weight(w, ..., col_scale=col_scale), in w's
    space (the dequantized columns divided by col_scale); `zero`: subtract the zero points.
    fp32 sums of blocks of rows (~1e-7 relative error), added up in Python floats."""
    n, k = w.shape
    q, scale, z = parts["qweight"], parts["scale"], parts["zero"] if zero else None
    g = scale.shape[1]
    rows = n if w.device.type != "cpu" else max(1, min(n, QUANT_CHUNK // max(k, 1)))
    bufs = torch.empty(2, rows * k, dtype=torch.float32, device=w.device)
    signal = noise = 0.0
    for a in range(0, n, rows):
        b = min(n, a + rows)
        f, d = (x[: (b - a) * k].view(b - a, k) for x in bufs)
        f.copy_(w[a:b])
        d.copy_(q[a:b])
        dg = d.view(b - a, g, k // g)  # [rows, G, group]
        if z is not None:
            dg.sub_(z[a:b, :, None])
        dg.mul_(scale[a:b, :, None])
        if col_scale is not None:
            d.div_(col_scale)
        d.sub_(f)
        signal += float(torch.dot(f.view(-1), f.view(-1)))
        noise += float(torch.dot(d.view(-1), d.view(-1)))
    return signal, noise


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of quantize_weight: [N, K] fp32."""
    n, k = qweight.shape
    g = scale.shape[1]
    q = qweight.float().reshape(n, g, k // g)  # q: [N, G, group]
    if zero is not None:
        q = q - zero.float()[..., None]
    return (q * scale.float()[..., None]).reshape(n, k)


def quantize_activation(x: torch.Tensor, inv_smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: x [..., K] -> (xq int8 [..., K], xscale fp32 [..., 1]).
    `inv_smooth` [K] (SmoothQuant) multiplies x before quantization."""
    v = x.float()
    if inv_smooth is not None:
        v = v * inv_smooth.float()
    amax = v.abs().amax(-1, keepdim=True)
    xscale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).clamp(min=SCALE_MIN)
    return torch.round(v / xscale).clamp(-127, 127).to(torch.int8), xscale


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(|ref|^2 / |ref - approx|^2), in dB."""
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


# -- references (CPU implementation, test oracle) ------------------------------------------


def linear_w8a16_reference(x, qweight, scale, zero, bias, group_size):
    # x: [..., K] -> [..., N]; the weight is dequantized to x's dtype, as the GPU kernel's
    # grouped path does (its per-channel path applies the scale after the fp32 accumulation).
    w = dequantize_weight(qweight, scale, zero).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def linear_w8a8_reference(x, qweight, scale, zero, bias, group_size, inv_smooth):
    # x: [..., K] -> [..., N]; exact integer products (float64 holds them), fp32 scaling.
    n, k = qweight.shape
    g = scale.shape[1]
    xq, xs = quantize_activation(x.reshape(-1, k), inv_smooth)  # xq: [M, K], xs: [M, 1]
    xg = xq.double().reshape(-1, g, k // g)  # [M, G, group]
    wg = qweight.double().reshape(n, g, k // g)  # [N, G, group]
    y = torch.zeros(xg.shape[0], n, device=x.device)
    for i in range(g):  # one group at a time: [M, N] at most
        acc = xg[:, i] @ wg[:, i].T  # [M, N], int32-exact
        if zero is not None:
            acc -= zero[:, i].double()[None] * xg[:, i].sum(-1)[:, None]
        y += acc.float() * scale[:, i].float()[None]
    y = y * xs  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# -- ONNX form (compiler/onnx_export.py): the weight enters through DequantizeLinear (QDQ) ------


@torch.library.custom_op("dsc_onnx::dequantize", mutates_args=())
def dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, block: int) -> torch.Tensor:
    """(qweight - zero) * scale, fp32: qweight [N, K] int8; scale (fp32) and zero (int8) [N]
    (block 0: one per row) or [N, K // block]. In ONNX: DequantizeLinear."""
    if block == 0:
        return dequantize_weight(qweight, scale[:, None], None if zero is None else zero[:, None])
    return dequantize_weight(qweight, scale, zero)


@dequantize.register_fake
def _(qweight, scale, zero, block):
    return qweight.new_empty(qweight.shape, dtype=torch.float32)


def _onnx_dequantize(qweight, scale, zero, block: int):
    from onnxscript import opset21 as op

    if block == 0:
        return op.DequantizeLinear(qweight, scale, zero, axis=0)
    return op.DequantizeLinear(qweight, scale, zero, axis=1, block_size=block)


declare("dsc_onnx.dequantize.default", onnx=KEEP, onnx_translation=_onnx_dequantize)


def _dequantize_qdq(qweight, scale, zero):
    # scale, zero: [N, G]; per-channel (G == 1) is DequantizeLinear's axis=0
    n, g = scale.shape
    if g == 1:
        return torch.ops.dsc_onnx.dequantize(qweight, scale.reshape(n), None if zero is None else zero.reshape(n), 0)
    return torch.ops.dsc_onnx.dequantize(qweight, scale, zero, qweight.shape[1] // g)


def linear_w8a16_qdq(x, qweight, scale, zero, bias, group_size):
    # as linear_w8a16_reference, the weight entering through DequantizeLinear
    w = _dequantize_qdq(qweight, scale, zero).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def linear_w8a8_qdq(x, qweight, scale, zero, bias, group_size, inv_smooth):
    # per-token activation quantization as the reference (standard ops), then a float matmul
    # of the dequantized operands: equal to the int32-exact reference up to fp32 rounding
    n, k = qweight.shape
    xq, xs = quantize_activation(x.reshape(-1, k), inv_smooth)  # xq: [M, K] int8, xs: [M, 1]
    y = F.linear(xq.float() * xs, _dequantize_qdq(qweight, scale, zero), None if bias is None else bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# -- custom ops ----------------------------------------------------------------------------


@torch.library.custom_op("dsc::linear_w8a16", mutates_args=())
def linear_w8a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    return linear_w8a16_reference(x, qweight, scale, zero, bias, group_size)


declare("dsc.linear_w8a16.default", quantized=True, bias_arg=4, onnx=linear_w8a16_qdq)


@linear_w8a16.register_fake
def _(x, qweight, scale, zero, bias, group_size):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@cuda_kernel(linear_w8a16)
def _(x, qweight, scale, zero, bias, group_size):
    k = x.shape[-1]
    y = w8a16_matmul(x.reshape(-1, k), qweight, scale, zero, bias, group_size)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


def linear_w8a16_swiglu_reference(x, qweight, scale, zero, group_size):
    # swiglu of the halves of linear_w8a16_reference(x, ...), qweight [2N, K] = [gate; up]
    y = linear_w8a16_reference(x, qweight, scale, zero, None, group_size)
    n = y.shape[-1] // 2
    return swiglu_reference(y[..., :n], y[..., n:])


@torch.library.custom_op("dsc::linear_w8a16_swiglu", mutates_args=())
def linear_w8a16_swiglu(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """dsc::swiglu of the halves of dsc::linear_w8a16(x, qweight, scale, zero, None, group_size),
    qweight [2N, K] = [gate; up] (no bias): the values of the two ops (the linear's output rounded
    to x's dtype, then swiglu). The decode_linears pass makes it of the pair; on CUDA at one row
    one kernel computes both halves' rows and the activation (`_w8a16_gemv_swiglu_kernel`),
    elsewhere the two ops run."""
    return linear_w8a16_swiglu_reference(x, qweight, scale, zero, group_size)


declare("dsc.linear_w8a16_swiglu.default", fuses=("dsc.linear_w8a16.default", "dsc.swiglu.default"))


@linear_w8a16_swiglu.register_fake
def _(x, qweight, scale, zero, group_size):
    return x.new_empty(*x.shape[:-1], qweight.shape[0] // 2)


@cuda_kernel(linear_w8a16_swiglu)
def _(x, qweight, scale, zero, group_size):
    n2, k = qweight.shape
    if x.numel() == k and n2 % 2 == 0 and qweight.is_contiguous():
        return w8a16_gemv_swiglu(x, qweight, scale, zero, group_size)
    y = torch.ops.dsc.linear_w8a16(x, qweight, scale, zero, None, group_size)
    return torch.ops.dsc.swiglu(y[..., : n2 // 2], y[..., n2 // 2 :])


@torch.library.custom_op("dsc::linear_w8a8", mutates_args=())
def linear_w8a8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    inv_smooth: torch.Tensor | None,
) -> torch.Tensor:
    return linear_w8a8_reference(x, qweight, scale, zero, bias, group_size, inv_smooth)


declare("dsc.linear_w8a8.default", quantized=True, bias_arg=4, onnx=linear_w8a8_qdq)


@linear_w8a8.register_fake
def _(x, qweight, scale, zero, bias, group_size, inv_smooth):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@cuda_kernel(linear_w8a8)
def _(x, qweight, scale, zero, bias, group_size, inv_smooth):
    k = x.shape[-1]
    y = w8a8_matmul(x.reshape(-1, k), qweight, scale, zero, bias, group_size, inv_smooth)
    return y.reshape(*x.shape[:-1], qweight.shape[0])


# -- Triton kernels --------------------------------------------------------------------------
# Scale modes, chosen by the constexpr GROUP_K (0: per-channel, else the group size):
#   per-channel          scale [N] applied to the fp32 accumulator once, at the end;
#   GROUP_K % BLOCK_K == 0  one scale per row per K-block, loaded once per iteration;
#   otherwise            scales gathered per element (odd group sizes, and the gemv's long
#                        K-blocks that span several groups; the gathers hit L1).
#
# int8 -> fp32 conversion. `w.to(tl.float32)` is I2F, which Hopper issues at 16 per clock per
# SM: converting a 4096 x 4096 weight alone takes ~4 us on an H200, as long as reading it. The
# CVT path does it on the ALU instead, four weights per 32-bit register: flip each byte's sign
# bit (b ^ 0x80 = v + 128), place the byte in the mantissa of 2^23 (prmt), subtract 2^23 + 128.
# PTX, so CUDA only; CVT is "" in the interpreter (config "FAST_CVT").
I8X4_TO_F32 = (
    "{.reg .b32 t;\n"
    "xor.b32 t, $4, 0x80808080;\n"
    "prmt.b32 $0, t, 0x4B000000, 0x7440;\n"
    "prmt.b32 $1, t, 0x4B000000, 0x7441;\n"
    "prmt.b32 $2, t, 0x4B000000, 0x7442;\n"
    "prmt.b32 $3, t, 0x4B000000, 0x7443;\n"
    "sub.f32 $0, $0, 0f4B000080;\n"
    "sub.f32 $1, $1, 0f4B000080;\n"
    "sub.f32 $2, $2, 0f4B000080;\n"
    "sub.f32 $3, $3, 0f4B000080;}"
)


@device
def _w8a16_rows(
    X,
    W,
    S,
    Z,
    offs_n,
    mask_n,
    K,
    G,
    GROUP_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    X_ROW: tl.constexpr,
    PDL: tl.constexpr,
):
    # y[n] = sum_k x[k] * (w[n, k] - z[n, g(k)]) * s[n, g(k)] for the weight rows offs_n, in fp32
    # ([BLOCK_N]; no bias); with PDL it waits (gdc_wait) after the first K-block's weights load
    # and before any other access. Shared by the W8A16 GEMV, its SwiGLU form (rows: gate and up
    # interleaved) and the GEMV that pushes its rows to the all-reduce (kernels/collectives.py)
    rows = offs_n.to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # per-lane partial sums, reduced once
    if PREFETCH:  # the next K-block's weights load while this one is multiplied (registers)
        w_next = tl.load(
            W + rows[:, None] + cols[None, :],
            mask=mask_n[:, None] & (cols < K)[None, :],
            other=0,
            eviction_policy="evict_first",
        )
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + cols
        mask = mask_n[:, None] & (offs_k < K)[None, :]
        if PREFETCH:
            w8 = w_next
            nk = offs_k + BLOCK_K
            w_next = tl.load(
                W + rows[:, None] + nk[None, :],
                mask=mask_n[:, None] & (nk < K)[None, :],
                other=0,
                eviction_policy="evict_first",
            )
        else:
            w8 = tl.load(
                W + rows[:, None] + offs_k[None, :], mask=mask, other=0, eviction_policy="evict_first"
            )  # w8: [BLOCK_N, BLOCK_K] int8, 16 B per lane
        if PDL:  # only the first K-block's weights (read-only; with PREFETCH the second's too) load
            if k0 == 0:  # before the wait, while the previous kernel finishes (not a pipelined loop)
                tl.extra.cuda.gdc_wait()
        if CVT != "":
            w = tl.inline_asm_elementwise(CVT, "=r,=r,=r,=r,r", [w8], dtype=tl.float32, is_pure=True, pack=4)
        else:
            w = w8.to(tl.float32)
        # x read as a [BLOCK_N, BLOCK_K] broadcast in w's layout: each thread loads only the x
        # values its lanes need, and the loop has no layout conversion (no barrier). X_ROW: x
        # read once as [BLOCK_K] and broadcast over the rows (fewer loads when BLOCK_N > 1)
        if X_ROW:
            x = tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
        else:
            x = tl.load(X + offs_k[None, :] + 0 * rows[:, None], mask=mask, other=0.0).to(tl.float32)
        if GROUP_K == 0:
            if HAS_ZERO:
                w -= tl.load(Z + offs_n, mask=mask_n, other=0).to(tl.float32)[:, None]
            acc += w * x
        elif GROUP_K % BLOCK_K == 0:
            g = k0 // GROUP_K
            if HAS_ZERO:
                w -= tl.load(Z + offs_n * G + g, mask=mask_n, other=0).to(tl.float32)[:, None]
            acc += w * x * tl.load(S + offs_n * G + g, mask=mask_n, other=0.0)[:, None]
        else:
            sidx = offs_n[:, None] * G + (offs_k // GROUP_K)[None, :]
            if HAS_ZERO:
                w -= tl.load(Z + sidx, mask=mask, other=0).to(tl.float32)
            acc += w * x * tl.load(S + sidx, mask=mask, other=0.0)
    if PDL:  # K == 0: no K-block waited above
        if K == 0:
            tl.extra.cuda.gdc_wait()
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if GROUP_K == 0:
        y *= tl.load(S + offs_n, mask=mask_n, other=0.0)
    return y


def _w8a16_gemv_kernel(
    X,
    W,
    S,
    Z,
    B,
    Y,
    N,
    K,
    G,
    GROUP_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    X_ROW: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # y[n] = sum_k x[k] * (w[n, k] - z[n, g(k)]) * s[n, g(k)] (+ b[n])   x: [K], w: [N, K], y: [N]
    if PDL:  # kernels/launch.py: the next kernel's programs may start now
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = _w8a16_rows(X, W, S, Z, offs_n, mask_n, K, G, GROUP_K, HAS_ZERO, CVT, BLOCK_N, BLOCK_K, PREFETCH, X_ROW, PDL)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


def _w8a16_gemv_swiglu_kernel(
    X,
    W,
    S,
    Z,
    Y,
    N,
    K,
    G,
    GROUP_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    CVT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    X_ROW: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # y[n] = silu(g[n]) * u[n], g and u the W8A16 GEMV's rows n and N + n of w [2N, K] (no bias):
    # kernels/linear.py's `_gemv_swiglu_kernel` over int8 weights. One tile of 2 BLOCK_N weight
    # rows, gate and up interleaved (row 2i: gate of output n0 + i, row 2i + 1: its up), each
    # result rounded to the dtype as the unfused linear's output is, then the swiglu kernel's math
    if PDL:  # kernels/launch.py: the next kernel's programs may start now
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.arange(0, 2 * BLOCK_N)
    offs_n = tl.program_id(0) * BLOCK_N + i // 2
    mask_n = offs_n < N
    gu = _w8a16_rows(
        X,
        W,
        S,
        Z,
        offs_n + (i % 2) * N,
        mask_n,
        K,
        G,
        GROUP_K,
        HAS_ZERO,
        CVT,
        2 * BLOCK_N,
        BLOCK_K,
        PREFETCH,
        X_ROW,
        PDL,
    )  # [2 BLOCK_N]
    g, u = tl.split(tl.reshape(gu, (BLOCK_N, 2)))  # [BLOCK_N] each
    dt = Y.dtype.element_ty
    y = _silu_mul(g.to(dt).to(tl.float32), u.to(dt).to(tl.float32), dt)
    offs_y = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(Y + offs_y, y, mask=offs_y < N)


def _w8a16_mma_kernel(
    X,
    W,
    S,
    Z,
    B,
    Y,
    P,
    LOCK,
    M,
    N,
    K,
    G,
    stride_xm,
    stride_ym,
    GROUP_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    CVT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # y [M, N] = x [M, K] @ dequant(w [N, K]).T
    #   tiles x [BLOCK_M, BLOCK_K] @ w^T [BLOCK_K, BLOCK_N] -> acc [BLOCK_M, BLOCK_N], or with
    #   SWAP_AB  w [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M] -> acc = y^T [BLOCK_N, BLOCK_M]
    # Every index below is an axis vector (m_ax, n_ax, k_w, k_x) of the tile it addresses, so one
    # body serves both orientations. SPLIT_K: program_id(2) sums its share of the K-blocks.
    if PDL:  # kernels/launch.py: the next kernel's programs may start now
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        m_ax, n_ax, k_w, k_x = offs_m[None, :], offs_n[:, None], cols[None, :], cols[:, None]
    else:
        m_ax, n_ax, k_w, k_x = offs_m[:, None], offs_n[None, :], cols[:, None], cols[None, :]
    mask_m, mask_n = m_ax < M, n_ax < N
    x_rows = X + m_ax.to(tl.int64) * stride_xm
    w_rows = W + n_ax.to(tl.int64) * K
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # K-blocks per split, whole blocks
    k_lo = tl.program_id(2) * k_len
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PDL:
        # The K loop is software-pipelined: its prologue loads the first stages of x and w, so
        # the wait must come before the loop. What can go before it: the first 1 KiB of each of
        # the program's weight rows (read-only; the prologue's K-blocks at the decode configs)
        # requested into L2, one prefetch per 128-byte line, addresses clamped into the weight.
        line = k_lo + tl.arange(0, 8) * 128
        lines = W + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K + tl.minimum(line, K - 1)[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // $0", "=r,l", [lines], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.extra.cuda.gdc_wait()
    for k0 in range(k_lo, tl.minimum(k_lo + k_len, K), BLOCK_K):
        x = tl.load(x_rows + k0 + k_x, mask=mask_m & (k0 + k_x < K), other=0.0)
        w8 = tl.load(
            w_rows + k0 + k_w, mask=(k0 + k_w < K) & mask_n, other=0, eviction_policy="evict_first"
        )  # w8: [BLOCK_K, BLOCK_N] int8 ([BLOCK_N, BLOCK_K] swapped)
        if CVT != "":
            w = tl.inline_asm_elementwise(CVT, "=r,=r,=r,=r,r", [w8], dtype=tl.float32, is_pure=True, pack=4)
        else:
            w = w8.to(tl.float32)
        if GROUP_K == 0:  # integers (w - z) are exact in 16-bit; the scale comes at the end
            if HAS_ZERO:
                w -= tl.load(Z + n_ax, mask=mask_n, other=0).to(tl.float32)
        elif GROUP_K % BLOCK_K == 0:
            g = k0 // GROUP_K
            if HAS_ZERO:
                w -= tl.load(Z + n_ax * G + g, mask=mask_n, other=0).to(tl.float32)
            w *= tl.load(S + n_ax * G + g, mask=mask_n, other=0.0)
        else:
            sidx = n_ax * G + (k0 + k_w) // GROUP_K
            smask = (k0 + k_w < K) & mask_n
            if HAS_ZERO:
                w -= tl.load(Z + sidx, mask=smask, other=0).to(tl.float32)
            w *= tl.load(S + sidx, mask=smask, other=0.0)
        if SWAP_AB:
            acc += tl.dot(w.to(x.dtype), x, input_precision=PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    if GROUP_K == 0:
        acc *= tl.load(S + n_ax, mask=mask_n, other=0.0)
    mask = mask_m & mask_n
    if SPLIT_K > 1:
        # partials P [SPLIT_K, M, N] fp32; the last split of this tile to finish (a counter per
        # tile in LOCK) sums them and writes y: one launch. The barrier orders every thread's
        # stores before the counter's release; the acquire makes the other splits' stores
        # visible to the last one, read past L1 (.cg).
        part = P + m_ax.to(tl.int64) * N + n_ax
        tl.store(part + (tl.program_id(2) * M).to(tl.int64) * N, acc, mask=mask)
        tl.debug_barrier()
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        done = tl.atomic_add(LOCK + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):
                acc += tl.load(part + (s * M).to(tl.int64) * N, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(B + n_ax, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(Y + m_ax.to(tl.int64) * stride_ym + n_ax, acc.to(Y.dtype.element_ty), mask=mask)
            tl.store(LOCK + tile, 0)  # ready for the next launch (and the next graph replay)
    else:
        if HAS_BIAS:
            acc += tl.load(B + n_ax, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Y + m_ax.to(tl.int64) * stride_ym + n_ax, acc.to(Y.dtype.element_ty), mask=mask)


@gluon_device
def _regs_k_block(w8, x, acc, Z, S, n_w, N, G, k_at, GROUP_K: gl.constexpr, HAS_ZERO: gl.constexpr, CVT: gl.constexpr):
    # one K-block of `_w8a16_regs_kernel`: int8 -> fp32 on the ALU, zero point and group scale
    # (k_at: [WARPS_K] each part's first k of this block), then the MMA into acc
    w = gl.inline_asm_elementwise(CVT, "=r,=r,=r,=r,r", [w8], dtype=gl.float32, is_pure=True, pack=4)
    if GROUP_K == 0:  # integers (w - z) are exact in 16-bit; the scale comes at the end
        if HAS_ZERO:
            w -= gl.load(Z + n_w, mask=n_w < N, other=0).to(gl.float32)[None, :, None]
    else:  # GROUP_K % BLOCK_K == 0 (int8_config makes it so): one group per part's K-block
        sg = n_w[None, :] * G + (k_at // GROUP_K)[:, None]  # [WARPS_K, BLOCK_N]
        sg = gl.minimum(sg, N * G - 1)  # a part past K (masked weights) still reads a valid scale
        if HAS_ZERO:
            w -= gl.load(Z + sg, mask=(n_w < N)[None, :], other=0).to(gl.float32)[:, :, None]
        w *= gl.load(S + sg, mask=(n_w < N)[None, :], other=0.0)[:, :, None]
    return mma_v2(w.to(x.dtype), x, acc)


def _w8a16_regs_kernel(
    X,
    W,
    S,
    Z,
    B,
    Y,
    P,
    LOCK,
    M,
    N,
    K,
    G,
    stride_xm,
    stride_ym,
    GROUP_K: gl.constexpr,
    HAS_ZERO: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    CVT: gl.constexpr,
    SPLIT_K: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    KW: gl.constexpr,
    WARPS_N: gl.constexpr,
    WARPS_K: gl.constexpr,
    PREFETCH: gl.constexpr,
    EARLY: gl.constexpr = False,
    PDL: gl.constexpr = False,
):
    # Gluon (explicit layouts): y^T [N, M] = dequant(w) [N, K] @ x^T [K, M] on mma.sync m16n8k16,
    # every operand loaded from global memory straight into the registers the MMA reads. The
    # weight tile's layout is the A operand's with KW consecutive k per thread (KW = 16: one
    # 16-byte load per thread and row), x^T's the B operand's with the same k order, so the
    # products pair the same k without any shuffle: no shared memory in the loop, no barrier,
    # and many programs in flight per SM (the M == 1 GEMV's scheme, with tensor cores doing
    # the M-fold multiply). The tiles are batched over WARPS_K parts of the program's K range
    # (batch p: k in part p), each part on its own warps: a program keeps WARPS_K K-blocks in
    # flight, and the parts are summed once at the end (through shared memory). A warp owns 16
    # rows of N per MMA (BLOCK_N / 16 / WARPS_N repeats); BLOCK_M: 8 (m16n8) or more (repeats).
    # SPLIT_K programs (grid axis 2) share K as in _w8a16_mma_kernel.
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS_K, WARPS_N, 1], instr_shape=[1, 16, 8]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)  # [WARPS_K, BLOCK_N, BLOCK_K]
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)  # [WARPS_K, BLOCK_K, BLOCK_M]
    if PDL:  # kernels/launch.py
        tl.extra.cuda.gdc_launch_dependents()
    k_len = gl.cdiv(gl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # this split's K range: whole K-blocks
    k_lo = gl.program_id(2) * k_len
    k_hi = gl.minimum(k_lo + k_len, K)
    k_part = gl.cdiv(gl.cdiv(k_len, WARPS_K), BLOCK_K) * BLOCK_K  # one part's
    # the operands' index vectors: parts p, rows n, k within a K-block, tokens m
    p_w = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    n_w = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    k_w = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    p_x = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_l)))
    k_x = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_l)))
    m_x = gl.program_id(1) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_l)))
    lo_w = (k_lo + p_w * k_part)[:, None, None]  # [WARPS_K, 1, 1]: each part's first k
    hi_w = gl.minimum(lo_w + k_part, k_hi)
    lo_x = (k_lo + p_x * k_part)[:, None, None]
    hi_x = gl.minimum(lo_x + k_part, k_hi)
    n_ok = (n_w < N)[None, :, None]
    w_ptrs = W + n_w.to(gl.int64)[None, :, None] * K + lo_w + k_w[None, None, :]
    x_ptrs = X + m_x.to(gl.int64)[None, None, :] * stride_xm + lo_x + k_x[None, :, None]
    x_ok = (m_x < M)[None, None, :]
    acc = gl.zeros([WARPS_K, BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    # With PDL, only EARLY's first K-block of weights (read-only) loads before the wait, while
    # the previous kernel finishes. Tried on the H200 and slower: the first K-block loaded
    # before the wait as a value carried into the loop (4096 x 14336 at M = 8: 29.1 us against
    # 20.8; int8 tensors carried across iterations take a register per byte), and the first
    # 1 KiB of each part's rows prefetched into L2 before the wait (26.3 us). EARLY peels the
    # first K-block off the loop instead.
    k_at = k_lo + p_w * k_part  # [WARPS_K]: each part's first k
    # EARLY 2: the second K-block too (a part of one or two blocks then loads all its weights
    # before the wait, overlapping the previous kernel's tail)
    if EARLY:
        w8_first = gl.load(
            w_ptrs, mask=n_ok & (lo_w + k_w[None, None, :] < hi_w), other=0, eviction_policy="evict_first"
        )
    if EARLY >= 2:
        w8_second = gl.load(
            w_ptrs + BLOCK_K,
            mask=n_ok & (lo_w + BLOCK_K + k_w[None, None, :] < hi_w),
            other=0,
            eviction_policy="evict_first",
        )
    if PDL:
        tl.extra.cuda.gdc_wait()
    if EARLY:
        x = gl.load(x_ptrs, mask=x_ok & (lo_x + k_x[None, :, None] < hi_x), other=0.0)
    if EARLY >= 2:
        x_second = gl.load(x_ptrs + BLOCK_K, mask=x_ok & (lo_x + BLOCK_K + k_x[None, :, None] < hi_x), other=0.0)
    if EARLY:
        acc = _regs_k_block(w8_first, x, acc, Z, S, n_w, N, G, k_at, GROUP_K, HAS_ZERO, CVT)
    if EARLY >= 2:
        acc = _regs_k_block(w8_second, x_second, acc, Z, S, n_w, N, G, k_at + BLOCK_K, GROUP_K, HAS_ZERO, CVT)
    for k0 in range(BLOCK_K * EARLY, k_part, BLOCK_K * (2 if PREFETCH else 1)):
        # PREFETCH: two K-blocks per iteration, both loaded before either is multiplied (5-7% slower
        # than without at the table's tiles on the H200; no row uses it)
        w8 = gl.load(
            w_ptrs + k0, mask=n_ok & (lo_w + k0 + k_w[None, None, :] < hi_w), other=0, eviction_policy="evict_first"
        )
        x = gl.load(x_ptrs + k0, mask=x_ok & (lo_x + k0 + k_x[None, :, None] < hi_x), other=0.0)
        if PREFETCH:
            k1 = k0 + BLOCK_K
            w8b = gl.load(
                w_ptrs + k1, mask=n_ok & (lo_w + k1 + k_w[None, None, :] < hi_w), other=0, eviction_policy="evict_first"
            )
            xb = gl.load(x_ptrs + k1, mask=x_ok & (lo_x + k1 + k_x[None, :, None] < hi_x), other=0.0)
        acc = _regs_k_block(w8, x, acc, Z, S, n_w, N, G, k_at + k0, GROUP_K, HAS_ZERO, CVT)
        if PREFETCH:
            acc = _regs_k_block(w8b, xb, acc, Z, S, n_w, N, G, k_at + k0 + BLOCK_K, GROUP_K, HAS_ZERO, CVT)
    y = gl.sum(acc, axis=0)  # [BLOCK_N, BLOCK_M]: the parts summed
    n_o = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(0, mma)))
    m_o = gl.program_id(1) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(0, mma)))
    if GROUP_K == 0:
        y *= gl.load(S + n_o, mask=n_o < N, other=0.0)[:, None]
    mask = (n_o < N)[:, None] & (m_o < M)[None, :]
    out = Y + m_o.to(gl.int64)[None, :] * stride_ym + n_o[:, None]
    if SPLIT_K > 1:  # as _w8a16_mma_kernel: fp32 partials, the tile's last split sums them
        part = P + m_o.to(gl.int64)[None, :] * N + n_o[:, None]
        gl.store(part + (gl.program_id(2) * M).to(gl.int64) * N, y, mask=mask)
        tl.debug_barrier()  # (gluon spells it thread_barrier in triton 3.6, barrier in 3.9)
        tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        done = gl.atomic_add(LOCK + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            y = gl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):
                y += gl.load(part + (s * M).to(gl.int64) * N, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                y += gl.load(B + n_o, mask=n_o < N, other=0.0).to(gl.float32)[:, None]
            gl.store(out, y.to(Y.dtype.element_ty), mask=mask)
            gl.store(LOCK + tile, 0)  # ready for the next launch (and the next graph replay)
    else:
        if HAS_BIAS:
            y += gl.load(B + n_o, mask=n_o < N, other=0.0).to(gl.float32)[:, None]
        gl.store(out, y.to(Y.dtype.element_ty), mask=mask)


def _quantize_rows_kernel(X, INV, Q, XS, K, stride_xm, HAS_SMOOTH: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per row: an amax pass, then a quantize pass (the row is in L2 the second time)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(X + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            v *= tl.load(INV + offs, mask=offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v))
    m = tl.max(amax, axis=0)
    scale = tl.maximum(tl.where(m > 0, m / 127.0, 1.0), 1.1754943508222875e-38)  # SCALE_MIN
    tl.store(XS + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(X + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            v *= tl.load(INV + offs, mask=offs < K, other=0.0)
        v = tl.minimum(tl.maximum(v / scale, -127.0), 127.0)
        # round half to even (as torch.round) without F2I: adding 1.5 * 2^23 rounds v to an
        # integer in the fp32 add; its low byte is then the two's-complement int8
        q = (v + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
        tl.store(Q + row * K + offs, q, mask=offs < K)


def _w8a8_kernel(
    XQ,
    XS,
    W,
    S,
    Z,
    B,
    Y,
    M,
    N,
    K,
    G,
    stride_ym,
    GROUP_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # y [M, N] = xs[m] * sum_g s[n, g] * (xq[m, g] . (w[n, g] - z[n, g]))   int8 tiles, int32 dots
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = XQ + offs_m.to(tl.int64)[:, None] * K
    w_rows = W + offs_n.to(tl.int64)[:, None] * K
    acc_i = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)  # per-channel: one int32 sum over K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # grouped: fp32 sum of scaled groups
    xsum = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0)  # [BM, BK]
        w = tl.load(
            w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0, eviction_policy="evict_first"
        )  # [BN, BK]: K-major, as int8 tensor cores want
        d = tl.dot(x, tl.trans(w), out_dtype=tl.int32)
        if GROUP_K == 0:
            acc_i += d
            if HAS_ZERO:
                xsum += tl.sum(x.to(tl.int32), axis=1)
        else:  # BLOCK_K divides GROUP_K (int8_config guarantees it)
            g = k0 // GROUP_K
            if HAS_ZERO:
                z = tl.load(Z + offs_n * G + g, mask=mask_n, other=0).to(tl.int32)
                d -= tl.sum(x.to(tl.int32), axis=1)[:, None] * z[None, :]
            acc += d.to(tl.float32) * tl.load(S + offs_n * G + g, mask=mask_n, other=0.0)[None, :]
    if GROUP_K == 0:
        if HAS_ZERO:
            acc_i -= xsum[:, None] * tl.load(Z + offs_n, mask=mask_n, other=0).to(tl.int32)[None, :]
        acc = acc_i.to(tl.float32) * tl.load(S + offs_n, mask=mask_n, other=0.0)[None, :]
    acc *= tl.load(XS + offs_m, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# -- configs ---------------------------------------------------------------------------------
# Defaults for sm_90 by design (kernels/tuning.json overrides them per shape class):
#  - gemv (M == 1): the weight is the only traffic. Every program is resident at once, so the
#    bytes in flight per SM are about N * BLOCK_K / #SMs: BLOCK_K = 1024 keeps ~30 KB in flight
#    per SM at N = 4096 (Little's law at ~4 TB/s), with 16-byte loads (4 per thread).
#  - mma, M <= 16: BLOCK_M = 16 (the smallest MMA tile), narrow N tiles so that N = 4096 still
#    gives >= 2 programs per SM, a 4-deep cp.async pipeline over 256-wide K-blocks.
#  - prefill: 128 x 128 tiles on wgmma (HGMMA / IGMMA in SASS), 3 stages.
_DEFAULTS = {
    "w8a16_gemv": {
        "BLOCK_N": 8,
        "BLOCK_K": 1024,
        "PREFETCH": False,
        "X_ROW": False,
        "FAST_CVT": True,
        "num_warps": 4,
        "num_stages": 1,
    },
    "w8a16_mma": {
        16: {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "FAST_CVT": True, "num_warps": 4, "num_stages": 4},
        64: {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "FAST_CVT": True, "num_warps": 4, "num_stages": 4},
        None: {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "FAST_CVT": True, "num_warps": 8, "num_stages": 3},
    },
    "w8a8": {
        16: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
        64: {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        None: {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    },
}


def m_bucket(m: int) -> int:
    """Shape-class bucket of the token count: powers of two up to 256, then 256."""
    return min(256, next_power_of_2(max(m, 1)))


def int8_kernel(mode: str, m: int) -> str:
    """Which kernel serves `mode` ("w8a16" | "w8a8") at m tokens (the tuning-table key of its
    configs)."""
    return "w8a8" if mode == "w8a8" else "w8a16_gemv" if m == 1 else "w8a16_mma"


def regs_default(n: int, k: int) -> dict:
    """The Gluon kernel's config for 2-8 tokens on sm_90 where the table has no row, by the
    weight's 16-row tiles (t = N / 16) and K; every program has 16 rows, and all but the long-K
    form load their first weight block before the PDL wait (EARLY):
      K > 4096, t <= 384  4 K parts of 128-wide blocks, split-K up to 4 until ~1024 programs
      K <= 1024           4 K parts of one 256-wide block each
      t < 128             4 K parts of 256, split-K 4 (few rows, long K)
      t <= 384            8 K parts of 256 (8 warps; one wave of programs on 132 SMs)
      t <= 512            8 K parts of 128
      else                4 K parts of 128
    Fitted on an H200 sweep at 8 tokens over 16 shapes (Llama-8B and -1B layers, their
    fused and tp 2 / 4 shards): it is the winner, or within 1.3% of it, at each, up to 31% under
    the previous rule (16 rows, 4 K parts of 128, split-K by t alone; still the first form).
    At 2 and 4 tokens the tiles are the same (8-wide) and so were the winners where measured."""
    t = cdiv(n, 16)
    wk, bk, splits, early = 4, 128, 1, True
    if k > 4096 and t <= 384:
        splits, early = max(1, min(4, 1024 // t)), False
    elif k <= 1024:
        bk = 256
    elif t < 128:
        bk, splits = 256, 4
    elif t <= 384:
        wk, bk = 8, 256
    elif t <= 512:
        wk = 8
    return {
        "REGS": True,
        "BLOCK_M": 8,
        "BLOCK_N": 16,
        "BLOCK_K": bk,
        "WARPS_K": wk,
        "num_warps": wk,
        "PREFETCH": False,
        "EARLY": early,
        "SPLIT_K": splits,
    }


def int8_config(
    kernel: str, m: int, n: int, k: int, group_k: int, arch: str, table: bool = True, x_bytes: int = 2
) -> dict:
    """Launch config of an int8 kernel: built-in default for the M bucket, then (`table`) the
    tuning table's entry for (kernel, "M<bucket>_N<n>_K<k>[_G<group>]"). A GEMM's BLOCK_K is
    shrunk to a power of two dividing the group size, so each K-block meets one scale per row.
    A w8a16_mma config with "REGS": true runs the Gluon kernel (`_w8a16_regs_kernel`): table
    rows, taken whole (a key a REGS row lacks means the kernel's own default, as
    `regs_constexprs` reads it: no other default's keys leak in), and on sm_90 the default at
    2-8 tokens (`regs_default`) where the shape has no row (a row without REGS is the Triton
    kernel's and overrides that kernel's default). table=False: the Triton kernel's built-in
    default alone (what runs where the Gluon kernel cannot). x_bytes: the activations' element
    size. The rows and defaults were measured with 16-bit x; with fp32 x the Triton kernel's
    BLOCK_K is halved, so each pipeline stage holds no more bytes than the 16-bit config's
    (Llama-8B's M64 [4096, 4096] row asked an H200 for 248 KiB of shared memory, over its
    227; test_int8_kernels compiles every such config for sm_90 and checks the limit)."""
    b = m_bucket(m)
    d = _DEFAULTS[kernel]
    if kernel in ("w8a16_mma", "w8a8"):
        d = d[16] if b <= 16 else d[64] if b <= 64 else d[None]
    shape_class = f"M{b}_N{n}_K{k}" + (f"_G{group_k}" if group_k else "")
    row = tuning_row(kernel, shape_class, arch) if table else None
    if kernel == "w8a16_mma" and row and row.get("REGS"):
        cfg = dict(row)
    elif kernel == "w8a16_mma" and table and arch == "sm_90" and b <= 8 and not row:
        cfg = regs_default(n, k)
    else:
        cfg = {**d, **(row or {})}  # the table's row (looked up once, above) over the default
    if group_k and kernel in ("w8a16_mma", "w8a8") and group_k % 16 == 0:
        bk = cfg["BLOCK_K"]
        while group_k % bk:
            bk //= 2
        cfg = {**cfg, "BLOCK_K": bk}
    if kernel == "w8a16_mma" and x_bytes > 2 and not cfg.get("REGS") and cfg["BLOCK_K"] >= 32:
        # a stage: BLOCK_M x BLOCK_K of x, BLOCK_N x BLOCK_K int8 of w; at half the K-block fp32
        # x takes the bytes bf16 x took (a divisor of a group's size stays one)
        cfg = {**cfg, "BLOCK_K": cfg["BLOCK_K"] // 2}
    return cfg


# -- launch wrappers -------------------------------------------------------------------------
def group_k(scale: torch.Tensor, group_size: int) -> int:
    """The group size the kernels, their configs and tuning rows key on: 0 for per-channel scales
    (one per row, scale [N, 1]), else group_size."""
    return 0 if scale.shape[1] == 1 else group_size


def _check(x, qweight, scale, zero, bias, group_size):
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.int8 or qweight.shape[1] != k:
        raise ValueError(f"qweight must be int8 [N, {k}], got {qweight.dtype} {list(qweight.shape)}")
    g = scale.shape[1]
    if scale.shape[0] != n or g * group_size != k:
        raise ValueError(
            f"scale {list(scale.shape)} does not match qweight {list(qweight.shape)} with group_size {group_size}"
        )
    if zero is not None and zero.shape != scale.shape:
        raise ValueError(f"zero {list(zero.shape)} must match scale {list(scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {list(bias.shape)} must be [{n}]")
    return m, n, k, g


def _split(cfg: dict, device: torch.device) -> tuple[dict, dict]:
    """(constexprs, launch options) of a config. FAST_CVT (inline PTX) becomes the CVT asm on
    CUDA devices and "" elsewhere (the interpreter)."""
    opts = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    const = {k: v for k, v in cfg.items() if k not in opts and k != "FAST_CVT"}
    if "FAST_CVT" in cfg:
        const["CVT"] = I8X4_TO_F32 if cfg["FAST_CVT"] and device.type == "cuda" else ""
    return const, opts


_W8A16_KERNELS = ("w8a16_gemv", "w8a16_mma")


def w8a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    kernel: str | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] fp16/bf16/fp32 -> [M, N] in x's dtype. kernel: "w8a16_gemv" (M == 1) or
    "w8a16_mma"; default by M. config: pin a launch config (tests, benchmarks)."""
    m, n, k, g = _check(x, qweight, scale, zero, bias, group_size)
    gk = 0 if g == 1 else group_size
    kernel = kernel or int8_kernel("w8a16", m)
    if kernel not in _W8A16_KERNELS:
        raise ValueError(f"unknown w8a16 kernel {kernel!r}; one of {_W8A16_KERNELS}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    cfg = config or int8_config(kernel, m, n, k, gk, arch_of(x.device), x_bytes=x.element_size())
    if kernel == "w8a16_mma" and cfg.get("REGS"):
        if _regs_usable(x, gk, cfg):
            return _w8a16_regs(x, qweight, scale, zero, bias, gk, g, cfg, y)
        if config:
            raise ValueError(
                "REGS (the Gluon kernel) needs a CUDA tensor in fp16/bf16 and BLOCK_K dividing the group size"
            )
        cfg = int8_config(kernel, m, n, k, gk, arch_of(x.device), table=False, x_bytes=x.element_size())
    defaults = {"w8a16_gemv": {"PREFETCH": False, "X_ROW": False}, "w8a16_mma": {"SWAP_AB": False, "SPLIT_K": 1}}
    const, opts = _split({"FAST_CVT": False, **defaults[kernel], **cfg}, x.device)
    flags = dict(GROUP_K=gk, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None)
    zero_ = zero if zero is not None else qweight  # any pointer: unused without HAS_ZERO
    bias_ = bias if bias is not None else scale
    if kernel == "w8a16_gemv":
        if m != 1:
            raise ValueError("the gemv kernel takes one row")
        jit(_w8a16_gemv_kernel)[(cdiv(n, const["BLOCK_N"]),)](
            x.contiguous(), qweight, scale, zero_, bias_, y, n, k, g, **flags, **const, **opts, **pdl_options(x.device)
        )
        return y
    grid = (cdiv(n, const["BLOCK_N"]), cdiv(m, const["BLOCK_M"]))
    splits = const["SPLIT_K"]
    if splits < 1:
        raise ValueError(f"w8a16_mma kernel: SPLIT_K must be >= 1, got {splits}")
    # split-K partials [SPLIT_K, M, N] fp32 and one counter per output tile (unused at SPLIT_K 1)
    part = torch.empty(splits, m, n, device=x.device, dtype=torch.float32) if splits > 1 else y
    lock = split_counters(x.device, grid[0] * grid[1]) if splits > 1 else y
    jit(_w8a16_mma_kernel)[grid + (splits,)](
        x,
        qweight,
        scale,
        zero_,
        bias_,
        y,
        part,
        lock,
        m,
        n,
        k,
        g,
        x.stride(0),
        y.stride(0),
        **flags,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **const,
        **opts,
        **pdl_options(x.device),
    )
    return y


W8A16_GEMV_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "PREFETCH", "X_ROW", "FAST_CVT")


def w8a16_gemv_row(kernel: str, n: int, k: int, group_k: int, arch: str) -> dict:
    """The config keys (`W8A16_GEMV_KEYS`) of a tuning-table row of a kernel built on the W8A16
    GEMV's loop ("w8a16_gemv_swiglu", "w8a16_gemv_push") for an int8 weight [n, k], {} if none:
    the rows also record what was measured ("us", "source"), which are not launch options."""
    row = tuning_row(kernel, f"M1_N{n}_K{k}" + (f"_G{group_k}" if group_k else ""), arch)
    return {key: row[key] for key in W8A16_GEMV_KEYS if key in row}


def w8a16_swiglu_config(n2: int, k: int, group_k: int, arch: str, x_bytes: int = 2) -> dict:
    """`_w8a16_gemv_swiglu_kernel`'s config for a [gate; up] int8 weight [n2, k] (n2 / 2 outputs):
    the W8A16 GEMV's (`int8_config`) at that shape with half its BLOCK_N (at least 1), so that
    a program's gate and up rows keep the GEMV's tuned [rows, BLOCK_K] tile; a tuning-table row
    `w8a16_gemv_swiglu` (BLOCK_N counting outputs) overrides it where one was measured."""
    cfg = int8_config("w8a16_gemv", 1, n2, k, group_k, arch, x_bytes=x_bytes)
    return {**cfg, "BLOCK_N": max(1, cfg["BLOCK_N"] // 2), **w8a16_gemv_row("w8a16_gemv_swiglu", n2, k, group_k, arch)}


def w8a16_gemv_swiglu(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    config: dict | None = None,
) -> torch.Tensor:
    """x [K] or [1, K] (any leading dims of one row), qweight [2N, K] = [gate; up] -> silu(gate x)
    * (up x) [..., N] in x's dtype with the fused kernel (config: `w8a16_swiglu_config`'s keys)."""
    n2, k = qweight.shape
    _, _, _, g = _check(x.reshape(-1, k), qweight, scale, zero, None, group_size)
    if x.numel() != k or n2 % 2:
        raise ValueError(
            f"w8a16_gemv_swiglu: one row of x against [gate; up] rows (an even count), got x "
            f"{list(x.shape)} and qweight {list(qweight.shape)}"
        )
    gk = 0 if g == 1 else group_size
    n = n2 // 2
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    cfg = config or w8a16_swiglu_config(n2, k, gk, arch_of(x.device), x.element_size())
    const, opts = _split({"FAST_CVT": False, "PREFETCH": False, "X_ROW": False, **cfg}, x.device)
    jit(_w8a16_gemv_swiglu_kernel)[(cdiv(n, const["BLOCK_N"]),)](
        x.contiguous(),
        qweight,
        scale,
        zero if zero is not None else qweight,
        y,
        n,
        k,
        g,
        GROUP_K=gk,
        HAS_ZERO=zero is not None,
        **const,
        **opts,
        **pdl_options(x.device),
    )
    return y


def _regs_fits(dtype: torch.dtype, gk: int, cfg: dict) -> bool:
    """Whether the Gluon kernel takes these operands: 16-bit x (the MMA's B operand as is),
    grouped scales only a whole K-block apart, and K-blocks of at least 4 * KW (int8_config
    shrinks BLOCK_K to divide a group: groups of 32 do not fit)."""
    return (
        dtype in (torch.float16, torch.bfloat16)
        and (gk == 0 or gk % cfg["BLOCK_K"] == 0)
        and cfg["BLOCK_K"] % (4 * cfg.get("KW", 16)) == 0
    )


def _regs_usable(x: torch.Tensor, gk: int, cfg: dict) -> bool:
    """Whether the Gluon kernel can run this call: `_regs_fits`, on a CUDA GPU (no interpreter)."""
    return x.device.type == "cuda" and _regs_fits(x.dtype, gk, cfg)


def regs_constexprs(cfg: dict) -> dict:
    """The Gluon kernel's tile constexprs (all but GROUP_K, HAS_ZERO, HAS_BIAS, PDL) from a REGS
    config, which gives num_warps and WARPS_K where the kernel takes WARPS_N and WARPS_K; raises
    for a tile its MMA layout cannot hold. The launch, the sm_90 build tests and
    `bench_int8.py --aot` all build from it."""
    warps, bm, bn, bk = cfg["num_warps"], cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    kw, splits, wk = cfg.get("KW", 16), cfg.get("SPLIT_K", 1), cfg.get("WARPS_K", 1)
    if warps % wk or bn % (16 * (warps // wk)) or bm % 8 or bk % (4 * kw) or splits < 1:
        raise ValueError(
            f"REGS config {cfg}: num_warps must be a multiple of WARPS_K, BLOCK_N of 16 * num_warps "
            f"/ WARPS_K, BLOCK_M of 8, BLOCK_K of 4 * KW, SPLIT_K >= 1"
        )
    return dict(
        CVT=I8X4_TO_F32,
        SPLIT_K=splits,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        KW=kw,
        WARPS_N=warps // wk,
        WARPS_K=wk,
        PREFETCH=bool(cfg.get("PREFETCH", False)),
        EARLY=int(cfg.get("EARLY", 0)),
    )


def _w8a16_regs(x, qweight, scale, zero, bias, gk, g, cfg, y):
    m, k = x.shape
    n = qweight.shape[0]
    const = regs_constexprs(cfg)
    splits = const["SPLIT_K"]
    grid = (cdiv(n, const["BLOCK_N"]), cdiv(m, const["BLOCK_M"]), splits)
    part = torch.empty(splits, m, n, device=x.device, dtype=torch.float32) if splits > 1 else y
    lock = split_counters(x.device, grid[0] * grid[1]) if splits > 1 else y
    gluon_jit(_w8a16_regs_kernel)[grid](
        x,
        qweight,
        scale,
        zero if zero is not None else qweight,
        bias if bias is not None else scale,
        y,
        part,
        lock,
        m,
        n,
        k,
        g,
        x.stride(0),
        y.stride(0),
        GROUP_K=gk,
        HAS_ZERO=zero is not None,
        HAS_BIAS=bias is not None,
        **const,
        num_warps=cfg["num_warps"],
        **pdl_options(x.device),
    )
    return y


def quantize_rows(x: torch.Tensor, inv_smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of quantize_activation for x [M, K]: (xq int8 [M, K], xscale fp32 [M])."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    xq = torch.empty(m, k, device=x.device, dtype=torch.int8)
    xs = torch.empty(m, device=x.device, dtype=torch.float32)
    if m:
        block = min(2048, next_power_of_2(k))
        inv = inv_smooth if inv_smooth is not None else xs
        jit(_quantize_rows_kernel)[(m,)](
            x,
            inv,
            xq,
            xs,
            k,
            x.stride(0),
            HAS_SMOOTH=inv_smooth is not None,
            BLOCK_K=block,
            num_warps=4 if block <= 1024 else 8,
        )
    return xq, xs


def w8a8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    inv_smooth: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: per-token int8 activations (one kernel), then the
    int8 x int8 -> int32 GEMM (a second). Grouped scales need group_size % 32 == 0."""
    m, n, k, g = _check(x, qweight, scale, zero, bias, group_size)
    if g > 1 and group_size % 32:
        raise ValueError(f"w8a8 kernel: group size {group_size} is not a multiple of 32")
    gk = 0 if g == 1 else group_size
    xq, xs = quantize_rows(x, inv_smooth)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    const, opts = _split(config or int8_config("w8a8", m, n, k, gk, arch_of(x.device)), x.device)
    if gk % const["BLOCK_K"]:
        raise ValueError(f"w8a8 kernel: BLOCK_K {const['BLOCK_K']} must divide the group size {gk}")
    zero_ = zero if zero is not None else qweight
    bias_ = bias if bias is not None else scale
    grid = (cdiv(n, const["BLOCK_N"]), cdiv(m, const["BLOCK_M"]))
    jit(_w8a8_kernel)[grid](
        xq,
        xs,
        qweight,
        scale,
        zero_,
        bias_,
        y,
        m,
        n,
        k,
        g,
        y.stride(0),
        GROUP_K=gk,
        HAS_ZERO=zero is not None,
        HAS_BIAS=bias is not None,
        **const,
        **opts,
    )
    return y


# -- planners (plan_kernels) -----------------------------------------------------------------
# M is the program's token count (symbolic at compile time): the plan records the config of
# every M bucket the kernel may meet, as the runtime will choose it on this arch.
_PLAN_BUCKETS = (1, 8, 16, 64, 256)


@planner("dsc.linear_w8a16.default")
def _plan_w8a16(x, qweight, scale, zero, bias, group_size, *, arch):
    n, k = qweight.shape
    gk = group_k(scale, group_size)
    cfg = {}
    for b in _PLAN_BUCKETS:
        c = int8_config(int8_kernel("w8a16", b), b, n, k, gk, arch, x_bytes=x.dtype.itemsize)
        if c.get("REGS") and not _regs_fits(x.dtype, gk, c):  # what w8a16_matmul runs instead
            c = int8_config(int8_kernel("w8a16", b), b, n, k, gk, arch, table=False, x_bytes=x.dtype.itemsize)
        cfg[f"M{b}"] = {"kernel": "w8a16_regs" if c.get("REGS") else int8_kernel("w8a16", b), **c}
    return {"name": "triton.w8a16", "config": cfg, "launches": 1}


@planner("dsc.linear_w8a16_swiglu.default")
def _plan_w8a16_swiglu(x, qweight, scale, zero, group_size, *, arch):
    """Counted at one row (batch 1 decode): the fused kernel, 1 launch; more rows take the W8A16
    matmul and the swiglu kernel."""
    n2, k = qweight.shape
    gk = group_k(scale, group_size)
    cfg = w8a16_swiglu_config(n2, k, gk, arch, x.dtype.itemsize)
    return {
        "name": "triton.w8a16_gemv_swiglu",
        "config": {"N": n2, "K": k, **cfg, "M>1": "triton.w8a16 + triton.swiglu"},
        "launches": 1,
    }


@planner("dsc.linear_w8a8.default")
def _plan_w8a8(x, qweight, scale, zero, bias, group_size, inv_smooth, *, arch):
    n, k = qweight.shape
    gk = group_k(scale, group_size)
    cfg = {f"M{b}": int8_config("w8a8", b, n, k, gk, arch) for b in _PLAN_BUCKETS}
    return {"name": "triton.w8a8", "config": cfg, "launches": 2}  # quantize_rows + GEMM
