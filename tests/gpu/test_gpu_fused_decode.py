"""GPU check section `fused_decode`: the decode fusions at real shapes.

1. `dsc::linear_swiglu` at one row (kernels/linear.py `gemv_swiglu`: the gate/up GEMV computing
   silu(gate) * up in its epilogue) against the reference (F.linear, then swiglu) and against
   the unfused GEMV + swiglu kernel pair, at the gate/up shapes of Llama-8B at tp 1/2/4 and
   Llama-1B, bf16 and fp16.
2. `dsc::rotary_attention` at decode (the decode attention kernel rotating q and the new k;
   also with rot_pos, reading the rows of [max_seq, D] tables itself: the same bits)
   against the reference and against dsc.rotary's kernel followed by the plain decode kernel,
   with Llama-8B's heads at tp 1 and 4 (32/8 and 8/2 heads, head_dim 128), contexts up to 8192,
   batches with different positions (one split and several), bf16 and fp16; the KV cache after
   the call too.
3. `dsc::linear_w8a16_swiglu` at one row (kernels/int8.py `w8a16_gemv_swiglu`, --int8's gate_up
   + SwiGLU) against the reference and the unfused W8A16 GEMV + swiglu pair, at the same gate/up
   shapes, per channel and in groups of 128, bf16, fp16 and fp32.
The fused kernels' timings against the unfused pairs: scripts/bench_kernels.py --section fused-decode.

    pytest tests/gpu/test_gpu_fused_decode.py          # $OUT/gpu_fused_decode.json when OUT is set
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from gpu_util import write_summary

REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # max |difference| / max |reference|


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def check_linear_swiglu(dtype) -> list[dict]:
    from dsc.kernels import linear
    from dsc.kernels.launch import arch_of

    rows = []
    for n, k in [(28672, 4096), (14336, 4096), (7168, 4096), (16384, 2048)]:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(1, k, device="cuda", generator=g).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(dtype)
        cfg = linear.gemv_swiglu_config(n, k, arch_of(x.device))
        row = {"shape": [n, k], "dtype": str(dtype), "config": cfg}
        if cfg is None:
            row["skipped"] = "no gemv row for this shape: the op runs F.linear + swiglu"
            rows.append(row)
            continue
        got = linear.gemv_swiglu(x, w, cfg)
        ref = linear.linear_swiglu_reference(x, w)
        g_cfg = linear.gemv_config(n, k, arch_of(x.device))
        up = linear.gemv(x, w, None, g_cfg) if g_cfg else torch.nn.functional.linear(x, w)
        unfused = torch.ops.dsc.swiglu(up[..., : n // 2], up[..., n // 2 :])
        op = torch.ops.dsc.linear_swiglu(x, w)
        row.update(
            rel_vs_reference=rel(got, ref),
            rel_vs_unfused=rel(got, unfused),
            bit_equal_unfused=bool(torch.equal(got, unfused)),
            op_equals_kernel=bool(torch.equal(op, got)),
            finite=bool(torch.isfinite(got).all()),
        )
        row["ok"] = row["finite"] and row["rel_vs_reference"] <= REL_TOL[dtype] and row["op_equals_kernel"]
        rows.append(row)
    return rows


W8A16_SWIGLU_SHAPES = [(28672, 4096), (14336, 4096), (7168, 4096), (16384, 2048)]  # Llama-8B tp 1/2/4, Llama-1B


def _int8_gate_up(n: int, k: int, group: int | None, seed: int):
    from dsc.kernels import int8

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)
    p = int8.quantize_weight(w, group, symmetric=group is None)
    return p["qweight"], p["scale"], None if group is None else p["zero"], group or k


def check_w8a16_swiglu(dtype) -> list[dict]:
    """`dsc::linear_w8a16_swiglu` at one row (kernels/int8.py `w8a16_gemv_swiglu`, --int8's decode
    gate_up + SwiGLU) against the reference (the W8A16 linear, then swiglu) and the unfused W8A16
    GEMV + swiglu kernel pair, per channel (symmetric) and in groups of 128 (asymmetric)."""
    from dsc.kernels import int8

    rows = []
    for (n, k), group in itertools.product(W8A16_SWIGLU_SHAPES, (None, 128)):
        q, s, z, gs = _int8_gate_up(n, k, group, n + k)
        x = torch.randn(1, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(k)).to(dtype)
        got = int8.w8a16_gemv_swiglu(x, q, s, z, gs)
        ref = int8.linear_w8a16_swiglu_reference(x.float(), q, s, z, gs).to(dtype)
        y = torch.ops.dsc.linear_w8a16(x, q, s, z, None, gs)
        unfused = torch.ops.dsc.swiglu(y[..., : n // 2], y[..., n // 2 :])
        op = torch.ops.dsc.linear_w8a16_swiglu(x, q, s, z, gs)
        row = {
            "shape": [n, k],
            "group": group,
            "dtype": str(dtype),
            "config": int8.w8a16_swiglu_config(n, k, group or 0, "sm_90", x.element_size()),
            "rel_vs_reference": rel(got, ref),
            "rel_vs_unfused": rel(got, unfused),
            "bit_equal_unfused": bool(torch.equal(got, unfused)),
            "op_equals_kernel": bool(torch.equal(op, got)),
            "finite": bool(torch.isfinite(got).all()),
        }
        row["ok"] = (
            row["finite"]
            and row["rel_vs_reference"] <= REL_TOL.get(dtype, 1e-4)
            and row["op_equals_kernel"]
            and row["rel_vs_unfused"] <= REL_TOL.get(dtype, 1e-4)
        )
        rows.append(row)
    return rows


def check_rotary_attention(dtype) -> list[dict]:
    from dsc.kernels import attention as A
    from dsc.kernels import rotary as R

    rows = []
    D, Smax, theta = 128, 8192, 500000.0
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device="cuda").float() / D)
    for H, Hkv in [(32, 8), (8, 2)]:
        for positions in ([127], [5000], [8191], [3, 700, 4100, 8000, 31, 1, 2047, 6000], [128] * 8):
            B = len(positions)
            g = torch.Generator(device="cuda").manual_seed(B * 7 + H)
            pos = torch.tensor(positions, device="cuda")
            ang = pos[:, None].float() * inv[None, :]
            emb = torch.cat((ang, ang), -1)[:, None, :]  # [B, 1, D], as fold_position_tables indexes
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            q = torch.randn(B, H, 1, D, device="cuda", generator=g).to(dtype)
            k = torch.randn(B, Hkv, 1, D, device="cuda", generator=g).to(dtype)
            v = torch.randn(B, Hkv, 1, D, device="cuda", generator=g).to(dtype)
            kc = torch.randn(B + 1, Hkv, Smax, D, device="cuda", generator=g).to(dtype)
            vc = torch.randn(B + 1, Hkv, Smax, D, device="cuda", generator=g).to(dtype)
            kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            kt, vt = kc.clone(), vc.clone()  # for the rot_pos form
            scale = D**-0.5
            got = A.decode_attention(q, k, v, kc, vc, pos, scale, rotary=(cos, sin))
            ref = A.rotary_attention_reference(q, k, v, cos, sin, kc2, vc2, pos, scale)
            qr, kr = R.rotary_triton(q, k, cos, sin)
            unfused = A.decode_attention(qr, kr, v, kc3, vc3, pos, scale)
            op = torch.ops.dsc.rotary_attention(q, k, v, cos, sin, kc3.clone(), vc3.clone(), pos, scale)
            # rot_pos: the tables [Smax, D] and the rows to read, as fuse_rotary_attention passes them
            # where cos / sin were fold_position_tables' lookups: the rows' bits, output and cache
            angs = torch.arange(Smax, device="cuda").float()[:, None] * inv[None, :]
            tables = torch.cat((angs, angs), -1)
            tables = (tables.cos().to(dtype), tables.sin().to(dtype))
            from_tables = A.decode_attention(q, k, v, kt, vt, pos, scale, rotary=tables, rot_pos=pos[:, None])
            row = {
                "heads": [H, Hkv],
                "positions": positions,
                "dtype": str(dtype),
                "rel_vs_reference": rel(got, ref),
                "rel_vs_unfused": rel(got, unfused),
                "bit_equal_unfused": bool(torch.equal(got, unfused)),
                "cache_equal_unfused": bool(torch.equal(kc, kc3) and torch.equal(vc, vc3)),
                "cache_rel_vs_reference": max(rel(kc, kc2), rel(vc, vc2)),
                "op_close_to_kernel": rel(op, got) <= REL_TOL[dtype],
                "finite": bool(torch.isfinite(got).all()),
                "tables_bit_equal": bool(torch.equal(from_tables, got) and torch.equal(kt, kc) and torch.equal(vt, vc)),
            }
            row["ok"] = (
                row["finite"]
                and row["rel_vs_reference"] <= REL_TOL[dtype]
                and row["tables_bit_equal"]
                and row["cache_rel_vs_reference"] <= REL_TOL[dtype]
                and row["op_close_to_kernel"]
            )
            rows.append(row)
    return rows


SUMMARY: list = []


def _assert_rows(rows, check, may_skip=False):
    """Every checked row ok; a row skipped (no tuned GEMV for its shape) only where may_skip."""
    SUMMARY.extend(dict(r, check=check) for r in rows)
    write_summary("gpu_fused_decode", SUMMARY)
    for r in rows:
        print(("ok  " if r.get("ok", True) else "FAIL") + f" {check} {r}", flush=True)
    checked = [r for r in rows if "ok" in r]
    assert (checked or may_skip) and all(r["ok"] for r in checked), [r for r in checked if not r["ok"]]


@pytest.fixture(scope="module", autouse=True)
def _ops():
    import dsc.kernels  # noqa: F401  (registers the dsc ops)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_w8a16_gemv_swiglu(dtype):
    _assert_rows(check_w8a16_swiglu(dtype), "w8a16_swiglu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemv_swiglu(dtype):
    _assert_rows(check_linear_swiglu(dtype), "linear_swiglu", may_skip=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rotary_attention(dtype):
    _assert_rows(check_rotary_attention(dtype), "rotary_attention")
