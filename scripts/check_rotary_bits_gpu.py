"""Which arithmetic does each rotary implementation compile to on the GPU? (a diagnostic)

dsc.rotary's kernel (kernels/rotary.py) and the decode attention kernel with ROTARY
(kernels/attention.py) share `rotate`: bf16(bf16(x * cos) + bf16(x_rot * sin)), each product
rounded to the input dtype, then the sum. In the Triton interpreter the two give the same bits;
on an H200 (session 8) the rotated k the fused kernel caches differed from the rotary kernel's
by an ulp in some elements. This script rotates one decode step's k both ways at Llama-8B's
shapes and compares every element with candidate formulas computed in torch. Session 9's run
found the fused kernel at fma_c on 100% of elements and the rotary kernel at no single formula
(FP contraction, see kernels/rotary.py ROTATE_OPTIONS); since the fix both are spec on 100%:

    spec        bf16(f32(bf16(x c)) + f32(bf16(r s)))    the one both kernels are written as
    no_round    bf16(x c + r s)                           products not rounded (fp32 sum)
    fma_c       bf16(fma(x, c, f32(bf16(r s))))           the x c product fused into the add
    fma_s       bf16(fma(r, s, f32(bf16(x c))))           the r s product fused into the add

and prints, per implementation and dtype, the fraction of elements each formula matches.

    python scripts/check_rotary_bits_gpu.py       # $OUT/check_rotary_bits_gpu.json when OUT is set
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 (both are "spec" there)


def candidates(x: torch.Tensor, r: torch.Tensor, c: torch.Tensor, s: torch.Tensor, dt) -> dict:
    """x, r (the rotate_half partner with its sign), c, s: fp32 tensors of dt-representable values."""
    xc, rs = x * c, r * s  # fp32 products (IEEE, no FMA in torch's elementwise mul)
    xc_r, rs_r = xc.to(dt).float(), rs.to(dt).float()
    f64 = torch.float64

    def fma(a, b, z):  # a * b exact in fp64 (8 x 24 significant bits), one rounding to fp32
        return (a.to(f64) * b.to(f64) + z.to(f64)).float()

    return {"spec": (xc_r + rs_r).to(dt), "no_round": (xc + rs).to(dt),
            "fma_c": fma(x, c, rs_r).to(dt), "fma_s": fma(r, s, xc_r).to(dt)}


def main() -> int:
    from dsc.kernels import attention as A, rotary as R

    out = []
    D, Smax, theta = 128, 1024, 500000.0
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device=DEV).float() / D)
    for dtype in (torch.bfloat16, torch.float16):
        B, H, Hkv = 4, 32, 8
        g = torch.Generator(device=DEV).manual_seed(0)
        pos = torch.tensor([127, 300, 5, 1000], device=DEV)
        ang = pos[:, None].float() * inv[None, :]
        emb = torch.cat((ang, ang), -1)[:, None, :]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        q = torch.randn(B, H, 1, D, device=DEV, generator=g).to(dtype)
        k = torch.randn(B, Hkv, 1, D, device=DEV, generator=g).to(dtype)
        v = torch.randn(B, Hkv, 1, D, device=DEV, generator=g).to(dtype)
        kc = torch.zeros(B, Hkv, Smax, D, device=DEV, dtype=dtype)
        vc = torch.zeros_like(kc)
        A.decode_attention(q, k, v, kc, vc, pos, D ** -0.5, rotary=(cos, sin))
        fused_k = kc[torch.arange(B), :, pos]  # [B, Hkv, D]: what the fused kernel cached
        _, kr = R.rotary_triton(q, k, cos, sin)
        kernel_k = kr[:, :, 0]  # [B, Hkv, D]
        x = k[:, :, 0].float()
        half = D // 2
        r = torch.cat((-x[..., half:], x[..., :half]), -1)  # rotate_half(x)
        c = cos[:, 0][:, None, :].float().expand(B, Hkv, D)
        s = sin[:, 0][:, None, :].float().expand(B, Hkv, D)
        cands = candidates(x, r, c, s, dtype)
        row = {"dtype": str(dtype), "elements": x.numel(),
               "fused_equals_kernel": float((fused_k == kernel_k).float().mean())}
        for name, got in (("rotary_kernel", kernel_k), ("fused_decode", fused_k)):
            row[name] = {f: float((got == ref).float().mean()) for f, ref in cands.items()}
        diff = (fused_k != kernel_k).nonzero()[:5].tolist()
        row["first_differences"] = [
            {"at": i, "x": float(x[tuple(i)]), "r": float(r[tuple(i)]), "cos": float(c[tuple(i)]),
             "sin": float(s[tuple(i)]), "rotary_kernel": float(kernel_k[tuple(i)]), "fused": float(fused_k[tuple(i)]),
             **{f: float(ref[tuple(i)]) for f, ref in cands.items()}} for i in diff]
        out.append(row)
        print(f"{row['dtype']}: fused == rotary kernel on {100 * row['fused_equals_kernel']:.2f}% of {row['elements']}")
        for name in ("rotary_kernel", "fused_decode"):
            print(f"  {name:14} matches " + ", ".join(f"{f} {100 * v:.2f}%" for f, v in row[name].items()))
        for d in row["first_differences"]:
            print("   ", d)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "check_rotary_bits_gpu.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
