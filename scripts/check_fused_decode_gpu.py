"""GPU check of the decode fusions at real shapes (run on a CUDA machine).

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
4. Timing (CUDA graphs, bf16, one row): each fused kernel against the unfused pair, and a small
   sweep of GEMV + swiglu configs per shape (`gemv_swiglu` rows for kernels/tuning.json); the
   W8A16 GEMV at Llama-8B's row-parallel shapes under its tuned config and under the configs the
   W8A16 GEMV push kernel raises it to at 2 and 4 ranks.

    python scripts/check_fused_decode_gpu.py [--no-timing] [--int8]    # exit 1 on a failure; $OUT/check_fused_decode_gpu.json
    (--int8: only the W8A16 checks and timing)
"""
from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
        unfused = torch.ops.dsc.swiglu(up[..., : n // 2], up[..., n // 2:])
        op = torch.ops.dsc.linear_swiglu(x, w)
        row.update(rel_vs_reference=rel(got, ref), rel_vs_unfused=rel(got, unfused),
                   bit_equal_unfused=bool(torch.equal(got, unfused)), op_equals_kernel=bool(torch.equal(op, got)),
                   finite=bool(torch.isfinite(got).all()))
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
        unfused = torch.ops.dsc.swiglu(y[..., : n // 2], y[..., n // 2:])
        op = torch.ops.dsc.linear_w8a16_swiglu(x, q, s, z, gs)
        row = {"shape": [n, k], "group": group, "dtype": str(dtype),
               "config": int8.w8a16_swiglu_config(n, k, group or 0, "sm_90", x.element_size()),
               "rel_vs_reference": rel(got, ref), "rel_vs_unfused": rel(got, unfused),
               "bit_equal_unfused": bool(torch.equal(got, unfused)), "op_equals_kernel": bool(torch.equal(op, got)),
               "finite": bool(torch.isfinite(got).all())}
        row["ok"] = (row["finite"] and row["rel_vs_reference"] <= REL_TOL.get(dtype, 1e-4) and row["op_equals_kernel"]
                     and row["rel_vs_unfused"] <= REL_TOL.get(dtype, 1e-4))
        rows.append(row)
    return rows


def time_w8a16_swiglu() -> list[dict]:
    """bf16, one row, per-channel int8: the fused W8A16 gate_up + SwiGLU kernel against the W8A16
    GEMV + swiglu pair, weight copies rotating past L2 (every call reads its weight from HBM)."""
    from dsc.kernels import int8

    out = []
    for n, k in W8A16_SWIGLU_SHAPES:
        copies = max(2, math.ceil(3 * 60 * 2**20 / (n * k)))
        ws = [_int8_gate_up(n, k, None, i) for i in range(copies)]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)

        def pair(q, s, z, gs):
            y = torch.ops.dsc.linear_w8a16(x, q, s, z, None, gs)
            return torch.ops.dsc.swiglu(y[..., : n // 2], y[..., n // 2:])

        row = {"shape": [n, k], "copies": copies, "config": int8.w8a16_swiglu_config(n, k, 0, "sm_90"),
               "gemv_then_swiglu_us": graph_us([lambda w=w: pair(*w) for w in ws]),
               "fused_us": graph_us([lambda w=w: int8.w8a16_gemv_swiglu(x, *w) for w in ws])}
        out.append(row)
        print(f"w8a16_swiglu {n}x{k}: W8A16 GEMV + swiglu {row['gemv_then_swiglu_us']:.2f} us, fused "
              f"{row['fused_us']:.2f} us", flush=True)
    return out


W8A16_ROW_PARALLEL_SHAPES = [(4096, 2048), (4096, 7168), (4096, 1024), (4096, 3584)]  # 8B o/down, tp 2 and 4


def time_w8a16_push_configs() -> list[dict]:
    """bf16, one row, per-channel int8, at Llama-8B's row-parallel shapes (o_proj, down_proj at
    tp 2 and 4): the W8A16 GEMV with its tuned config against the same GEMV with the config the
    GEMV push kernel takes at 2 and 4 ranks (`w8a16_push_config`'s, tuning rows included, raised by
    `gemv_push_norm_config`: more warps and rows per program so the last program holds the row in
    one pass). The plain GEMV runs both, so the difference is the config's own cost, not the
    push's (the norm's registers come on top)."""
    from dsc.kernels import int8
    from dsc.kernels.collectives import gemv_push_norm_config, w8a16_push_config

    out = []
    for n, k in W8A16_ROW_PARALLEL_SHAPES:
        copies = max(2, math.ceil(3 * 60 * 2**20 / (n * k)))
        ws = [_int8_gate_up(n, k, None, i) for i in range(copies)]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        tuned = int8.int8_config("w8a16_gemv", 1, n, k, 0, "sm_90", x_bytes=2)
        row = {"shape": [n, k], "copies": copies, "tuned": tuned}
        for name, cfg in [("tuned", tuned)] + [
                (f"push_norm_world{w}", {key: v for key, v in
                                         gemv_push_norm_config(w8a16_push_config(n, k, 0, "sm_90"), n, w).items()
                                         if key not in ("CHUNK", "NORM_N", "BLOCK_W")}) for w in (2, 4)]:
            row[f"{name}_config"] = cfg
            row[f"{name}_us"] = graph_us([lambda w=w, c=cfg: int8.w8a16_matmul(x, w[0], w[1], w[2], None, w[3],
                                                                              kernel="w8a16_gemv", config=c)
                                          for w in ws])
        out.append(row)
        print(f"w8a16_gemv {n}x{k}: tuned {row['tuned_us']:.2f} us (BLOCK_N {tuned['BLOCK_N']}, {tuned['num_warps']} "
              f"warps); the push configs: 2 ranks {row['push_norm_world2_us']:.2f} us, 4 ranks "
              f"{row['push_norm_world4_us']:.2f} us (BLOCK_N {row['push_norm_world4_config']['BLOCK_N']}, "
              f"{row['push_norm_world4_config']['num_warps']} warps)", flush=True)
    return out


def check_rotary_attention(dtype) -> list[dict]:
    from dsc.kernels import attention as A, rotary as R

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
            scale = D ** -0.5
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
            row = {"heads": [H, Hkv], "positions": positions, "dtype": str(dtype),
                   "rel_vs_reference": rel(got, ref), "rel_vs_unfused": rel(got, unfused),
                   "bit_equal_unfused": bool(torch.equal(got, unfused)), "cache_equal_unfused":
                   bool(torch.equal(kc, kc3) and torch.equal(vc, vc3)),
                   "cache_rel_vs_reference": max(rel(kc, kc2), rel(vc, vc2)),
                   "op_close_to_kernel": rel(op, got) <= REL_TOL[dtype], "finite": bool(torch.isfinite(got).all()),
                   "tables_bit_equal": bool(torch.equal(from_tables, got) and torch.equal(kt, kc) and torch.equal(vt, vc))}
            row["ok"] = (row["finite"] and row["rel_vs_reference"] <= REL_TOL[dtype] and row["tables_bit_equal"]
                         and row["cache_rel_vs_reference"] <= REL_TOL[dtype] and row["op_close_to_kernel"])
            rows.append(row)
    return rows


def graph_us(fns, iters=30) -> float:
    """us per call of fns (called in turn, each on its own weight copy) captured in one CUDA
    graph, as a decode step replays them."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / iters / len(fns)


def time_linear_swiglu() -> list[dict]:
    """bf16, one row: the fused kernel with its derived config and a small sweep (rows for
    kernels/tuning.json `gemv_swiglu`, BLOCK_N counting outputs) against the GEMV + swiglu pair.
    Weight copies rotate past the 60 MiB L2, so every call reads its weight from HBM."""
    from dsc.kernels import activation, linear
    from dsc.kernels.launch import arch_of

    out = []
    for n, k in [(28672, 4096), (14336, 4096), (7168, 4096), (16384, 2048)]:
        copies = max(2, math.ceil(3 * 60 * 2**20 / (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) / 64 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        arch = arch_of(x.device)
        g_cfg, f_cfg = linear.gemv_config(n, k, arch), linear.gemv_swiglu_config(n, k, arch)
        if g_cfg is None:
            continue
        row = {"shape": [n, k], "copies": copies, "gemv_config": g_cfg, "fused_config": f_cfg,
               "gemv_then_swiglu_us": graph_us([lambda w=w: activation.swiglu_triton(*linear.gemv(x, w, None, g_cfg).chunk(2, -1))
                                                for w in ws]),
               "fused_us": graph_us([lambda w=w: linear.gemv_swiglu(x, w, f_cfg) for w in ws])}
        tried = {}
        for bn, bk, warps in itertools.product((1, 2, 4), (256, 512, 1024, 2048), (1, 2, 4, 8)):
            if not 8 <= 2 * bn * bk // (32 * warps) <= 64 or bk > k:  # elements per thread
                continue
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
            tried[f"bn{bn}_bk{bk}_w{warps}"] = graph_us([lambda w=w: linear.gemv_swiglu(x, w, cfg) for w in ws])
        best = min(tried, key=tried.get)
        row.update(tried=tried, best=best, best_us=tried[best])
        out.append(row)
        print(f"linear_swiglu {n}x{k}: GEMV + swiglu {row['gemv_then_swiglu_us']:.2f} us, fused {row['fused_us']:.2f} us "
              f"({f_cfg}), best {best} {tried[best]:.2f} us", flush=True)
        del ws
    return out


def time_rotary_attention() -> list[dict]:
    """bf16 decode at batch 1, context 128 and 4096: the fused kernel against dsc.rotary's kernel
    then the decode kernel (Llama-8B heads at tp 1 and 4)."""
    from dsc.kernels import attention as A, rotary as R

    out, D = [], 128
    for H, Hkv in [(32, 8), (8, 2)]:
        for ctx in (128, 4096):
            q = torch.randn(1, H, 1, D, device="cuda").to(torch.bfloat16)
            k, v = (torch.randn(1, Hkv, 1, D, device="cuda").to(torch.bfloat16) for _ in range(2))
            cos, sin = (torch.rand(1, 1, D, device="cuda").to(torch.bfloat16) for _ in range(2))
            kc, vc = (torch.randn(2, Hkv, 8192, D, device="cuda").to(torch.bfloat16) for _ in range(2))
            pos = torch.tensor([ctx], device="cuda")
            fused = graph_us([lambda: A.decode_attention(q, k, v, kc, vc, pos, D ** -0.5, rotary=(cos, sin))] * 16)
            unfused = graph_us([lambda: A.decode_attention(*R.rotary_triton(q, k, cos, sin), v, kc, vc, pos, D ** -0.5)] * 16)
            out.append({"heads": [H, Hkv], "context": ctx, "fused_us": fused, "rotary_then_attention_us": unfused})
            print(f"rotary_attention heads {H}/{Hkv} context {ctx}: fused {fused:.2f} us, rotary + attention {unfused:.2f} us",
                  flush=True)
    return out


def main() -> int:
    import dsc.kernels  # noqa: F401  (registers the dsc ops)

    rows = []
    int8_only = "--int8" in sys.argv  # only the W8A16 gate_up + SwiGLU (checks and timing)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows += [dict(r, check="w8a16_swiglu") for r in check_w8a16_swiglu(dtype)]
        if dtype != torch.float32 and not int8_only:
            rows += [dict(r, check="linear_swiglu") for r in check_linear_swiglu(dtype)]
            rows += [dict(r, check="rotary_attention") for r in check_rotary_attention(dtype)]
    timing = {}
    if "--no-timing" not in sys.argv:
        timing = {"w8a16_swiglu": time_w8a16_swiglu(), "w8a16_push_configs": time_w8a16_push_configs()}
        if not int8_only:
            timing.update(linear_swiglu=time_linear_swiglu(), rotary_attention=time_rotary_attention())
    for r in rows:
        print(("ok  " if r.get("ok", True) else "FAIL") + " " + json.dumps(r), flush=True)
    failed = [r for r in rows if not r.get("ok", True)]
    checked = [r for r in rows if "ok" in r]
    print(f"{len(checked) - len(failed)}/{len(checked)} passed ({len(rows) - len(checked)} skipped); "
          f"bit-equal to the unfused kernels: {sum(r['bit_equal_unfused'] for r in checked)}/{len(checked)}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "check_fused_decode_gpu.json").write_text(json.dumps({"checks": rows, "timing": timing}, indent=1))
    return 1 if failed or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
