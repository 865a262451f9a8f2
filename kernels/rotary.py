"""Rotary position embedding of queries and keys in one launch: `dsc::rotary`.

    rotary(q, k, cos, sin) -> (q_out, k_out)
    q: [B, Hq, S, D], k: [B, Hk, S, D]   any strides with unit stride in D (typically
                                         transposed views of the fused qkv output)
    cos, sin: [B, S, D]                  the model's rotary tables (rotary_emb's output)
    q_out, k_out: contiguous [B, H, S, D]
    out = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

One program per (token, block of BLOCK_H heads), q heads first then k heads: it reads the
token's cos/sin row and its heads' two halves once and writes them once. Each product and
the sum are rounded to the input dtype, as Hugging Face's apply_rotary_pos_emb does in 16-bit.
"""

from __future__ import annotations

import torch

from dsc.kernels.launch import arch_of, cdiv, device, jit, next_power_of_2, pdl_options, planner, tuned
from dsc.kernels.registry import cuda_kernel, declare

tl = None  # triton.language, bound by launch.triton_jit on first launch


# -- Triton kernel ----------------------------------------------------------------------------
# Compile option of every kernel that calls `rotate`. Triton contracts floating-point ops by
# default, and LLVM first narrows bf16(f32(a) * f32(b)) to a bf16 multiply and the sum of two
# such products to a bf16 add, then fuses one multiply into the add: fma(x, cos, bf16(x_rot *
# sin)) on an H200, one rounding fewer than written, different in the two kernels that rotate
# (about 10% of elements an ulp apart, seen in the two kernels' PTX and outputs). Without contraction
# both compute exactly `rotate`'s arithmetic, transformers' 16-bit one.
ROTATE_OPTIONS = {"enable_fp_fusion": False}


@device
def rotate(x, cos, x_rot, sin, dt):
    """x * cos + rotate_half(x) * sin, elementwise, fp32 in and out: x_rot * sin is rotate_half's
    term (x_rot = -x[d + D/2] below D/2, x[d - D/2] from D/2 on; or x[(d + D/2) mod D] with sin
    negated below D/2, the same bits). Each product is rounded to dt (the input dtype) and the
    caller rounds the sum, as transformers' 16-bit ops do. Shared with the decode attention
    kernel, which rotates q and k as it loads them (kernels/attention.py)."""
    return (x * cos).to(dt).to(tl.float32) + (x_rot * sin).to(dt).to(tl.float32)


def _rotary_kernel(
    Q,
    K,
    COS,
    SIN,
    QO,
    KO,
    sq_b,
    sq_h,
    sq_s,
    sk_b,
    sk_h,
    sk_s,
    sc_b,
    sc_s,
    ss_b,
    ss_s,
    S,
    HQ,
    HK,
    HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # kernels/launch.py: let the next kernel start; wait for the previous one before any access
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)  # token = b * S + s
    hb = tl.program_id(1)
    b = t // S
    s = t % S
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    c_row = COS + b * sc_b + s * sc_s
    s_row = SIN + b * ss_b + s * ss_s
    c1 = tl.load(c_row + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    n_qb = tl.cdiv(HQ, BLOCK_H)
    if hb < n_qb:
        x_row = Q + b * sq_b + s * sq_s
        x_hs = sq_h
        o_row = QO + (b * HQ * S + s) * (2 * HALF)
        H = HQ
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    else:
        x_row = K + b * sk_b + s * sk_s
        x_hs = sk_h
        o_row = KO + (b * HK * S + s) * (2 * HALF)
        H = HK
        h = (hb - n_qb) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (h[:, None] < H) & dm[None, :]
    xp = x_row + h[:, None] * x_hs + d[None, :]
    x1 = tl.load(xp, mask=m, other=0.0)
    x2 = tl.load(xp + HALF, mask=m, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = rotate(x1, c1, -x2, s1, dt)
    o2 = rotate(x2, c2, x1, s2, dt)
    op = o_row + h[:, None] * (S * 2 * HALF) + d[None, :]
    tl.store(op, o1.to(dt), mask=m)
    tl.store(op + HALF, o2.to(dt), mask=m)


# -- configs ----------------------------------------------------------------------------------
def rotary_config(head_dim: int, arch: str) -> dict:
    """{"BLOCK_H", "BLOCK_D", "num_warps"}: BLOCK_H heads of one token per program."""
    default = {"BLOCK_H": 4, "num_warps": 4}
    return {"BLOCK_D": next_power_of_2(head_dim // 2), **tuned("rotary", f"D{head_dim}", arch, default)}


# -- wrapper ----------------------------------------------------------------------------------
def check_rotary(q, k, cos, sin) -> None:
    """The forms `rotary` takes (and `rotary_attention`, which rotates in the attention kernel)."""
    B, HQ, S, D = q.shape
    HK = k.shape[1]
    if k.shape != (B, HK, S, D) or cos.shape != (B, S, D) or sin.shape != (B, S, D) or D % 2:
        raise ValueError(
            f"rotary: q {list(q.shape)}, k {list(k.shape)}, cos {list(cos.shape)}, "
            f"sin {list(sin.shape)}: expected [B,Hq,S,D], [B,Hk,S,D], [B,S,D] x2, D even"
        )
    if k.dtype != q.dtype:
        raise ValueError(f"rotary: q is {q.dtype}, k is {k.dtype}")


def check_rotary_tables(q, k, cos, sin, rot_pos) -> None:
    """`rotary_attention` with rot_pos: cos and sin are tables [P, D] and rot_pos [B, S] the rows
    whose values dsc.rotary would get (cos = table[rot_pos])."""
    B, _, S, D = q.shape
    if cos.dim() != 2 or sin.shape != cos.shape or cos.shape[1] != D:
        raise ValueError(f"rotary: tables cos {list(cos.shape)}, sin {list(sin.shape)}: expected [P, {D}] x2")
    if rot_pos.shape != (B, S) or rot_pos.is_floating_point():
        raise ValueError(f"rotary: rot_pos {list(rot_pos.shape)} {rot_pos.dtype}: expected integers [{B}, {S}]")
    check_rotary(q, k, *(t[:1].expand(B, S, D) for t in (cos, sin)))  # the other checks (no gather)


def rotary_rows(cos, sin, rot_pos):
    """dsc.rotary's cos and sin [B, S, D] from tables [P, D] and rows rot_pos [B, S]."""
    return cos[rot_pos], sin[rot_pos]


def rotary_triton(q, k, cos, sin, config: dict | None = None):
    check_rotary(q, k, cos, sin)
    B, HQ, S, D = q.shape
    HK = k.shape[1]
    q, k, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin))
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    cfg = dict(config or rotary_config(D, arch_of(q.device)))
    if B * S:
        num_warps, bh = cfg.pop("num_warps"), cfg["BLOCK_H"]
        grid = (B * S, cdiv(HQ, bh) + cdiv(HK, bh))
        jit(_rotary_kernel)[grid](
            q,
            k,
            cos,
            sin,
            qo,
            ko,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            cos.stride(0),
            cos.stride(1),
            sin.stride(0),
            sin.stride(1),
            S,
            HQ,
            HK,
            D // 2,
            num_warps=num_warps,
            **cfg,
            **pdl_options(q.device),
            **ROTATE_OPTIONS,
        )
    return qo, ko


# -- reference --------------------------------------------------------------------------------
def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, D]
    return (q * cos + _rotate_half(q) * sin).contiguous(), (k * cos + _rotate_half(k) * sin).contiguous()


# -- custom op --------------------------------------------------------------------------------
@torch.library.custom_op("dsc::rotary", mutates_args=())
def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_reference(q, k, cos, sin)


declare("dsc.rotary.default")


@cuda_kernel(rotary)
def _(q, k, cos, sin):
    return rotary_triton(q, k, cos, sin)


@rotary.register_fake
def _(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@planner("dsc.rotary.default")
def _plan_rotary(q, k, cos, sin, *, arch):
    return {"name": "triton.rotary", "config": rotary_config(q.shape[-1], arch), "launches": 1}
