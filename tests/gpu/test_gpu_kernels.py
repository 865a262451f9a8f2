"""GPU check section `kernels`: the fused Triton kernels (norm, activation, rotary, vocab
embedding) against their references at real shapes: Llama-3-8B (hidden 4096, 32 heads, 8 kv
heads, head_dim 128, intermediate 14336) and GPT-2-XL (hidden 1600) widths, bf16 and fp16, decode
and prefill row counts, contexts up to 8192.

    pytest tests/gpu/test_gpu_kernels.py                                  # under a minute on an H200
    TRITON_INTERPRET=1 python tests/gpu/test_gpu_kernels.py --smoke        # the same code, tiny shapes, CPU

Each case runs the Triton wrapper and the plain-torch reference on the same inputs and
requires torch.testing.assert_close at the dtype's default tolerance (the kernels keep the
reference's rounding points, so they agree to about an ulp), no NaN/inf, and contiguous
outputs. Also: each `dsc::` op dispatches to its Triton kernel on CUDA (bit-equal to the
wrapper), and ops replay correctly from a captured CUDA graph with new inputs.
Writes $OUT/gpu_kernels.json when OUT is set.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from gpu_util import ROOT, cpu_smoke, run_smoke, write_summary

from dsc.kernels import activation as ACT
from dsc.kernels import embedding as EMB
from dsc.kernels import norm as NORM
from dsc.kernels import rotary as ROT

SMOKE = __name__ == "__main__" and "--smoke" in sys.argv
DEVICE = "cpu" if SMOKE else "cuda"


def s(n: int, small: int) -> int:
    return small if SMOKE else n


def rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


def cases(dtype):
    """name -> fn(g) -> (got tensors, want tensors)."""
    H, HKV, D, E, I, E2 = s(32, 4), s(8, 2), s(128, 16), s(4096, 72), s(14336, 200), s(1600, 40)
    out = {}
    for rows in (1, 7, s(4096, 9), s(16384, 33)):

        def add_rms(g, rows=rows):
            x, r = rand(g, rows, E, dtype=dtype), rand(g, rows, E, dtype=dtype)
            w = (1 + 0.1 * torch.randn(E, generator=g, device=DEVICE)).to(dtype)
            return NORM.add_norm_triton("rms", x, r, w, None, 1e-5), NORM.add_rmsnorm_reference(x, r, w, 1e-5)

        out[f"add_rmsnorm rows={rows} N={E}"] = add_rms
    for rows in (1, s(4096, 9)):

        def rms(g, rows=rows):
            x = rand(g, rows, E, dtype=dtype, scale=3)
            w = (1 + 0.1 * torch.randn(E, generator=g, device=DEVICE)).to(dtype)
            return NORM.add_norm_triton("rms", x, None, w, None, 1e-6)[1:], (NORM.rmsnorm_reference(x, w, 1e-6),)

        out[f"rmsnorm rows={rows} N={E}"] = rms
        for n in (E2, E):

            def add_ln(g, rows=rows, n=n):
                x, r = rand(g, rows, n, dtype=dtype), rand(g, rows, n, dtype=dtype, scale=2)
                w, b = rand(g, n, dtype=dtype), rand(g, n, dtype=dtype)
                return NORM.add_norm_triton("layer", x, r, w, b, 1e-5), NORM.add_layernorm_reference(x, r, w, b, 1e-5)

            out[f"add_layernorm rows={rows} N={n}"] = add_ln

            def add_ln_xbias(g, rows=rows, n=n):  # GPT-2's output projections: their bias moved here
                x, r = rand(g, rows, n, dtype=dtype), rand(g, rows, n, dtype=dtype, scale=2)
                w, b, xb = rand(g, n, dtype=dtype), rand(g, n, dtype=dtype), rand(g, n, dtype=dtype)
                return (
                    NORM.add_norm_triton("layer", x, r, w, b, 1e-5, x_bias=xb),
                    NORM.add_layernorm_reference(x, r, w, b, 1e-5, xb),
                )

            out[f"add_layernorm+x_bias rows={rows} N={n}"] = add_ln_xbias
    for rows in (1, 7, s(4096, 9)):

        def swiglu(g, rows=rows):
            gu = rand(g, rows, 2 * I, dtype=dtype, scale=2)  # the fused gate_up output; slices read in place
            gate, up = gu[:, :I], gu[:, I:]
            return (ACT.swiglu_triton(gate, up),), (ACT.swiglu_reference(gate, up),)

        out[f"swiglu rows={rows} N={I} (strided halves)"] = swiglu
        for n, approx in ((4 * E2, "tanh"), (I, "none")):

            def gelu(g, rows=rows, n=n, approx=approx):
                x = rand(g, rows, n, dtype=dtype, scale=3)
                return (ACT.gelu_triton(x, approx),), (ACT.gelu_reference(x, approx),)

            out[f"gelu-{approx} rows={rows} N={n}"] = gelu

            def gelu_bias(g, rows=rows, n=n, approx=approx):  # GPT-2's c_fc bias moved here
                x, b = rand(g, rows, n, dtype=dtype, scale=3), rand(g, n, dtype=dtype)
                return (ACT.gelu_triton(x, approx, b),), (ACT.gelu_reference(x, approx, b),)

            out[f"gelu-{approx}+bias rows={rows} N={n}"] = gelu_bias
    for B, S in ((1, 1), (32, 1), (2, s(2048, 5)), (1, s(8192, 11))):

        def rotary(g, B=B, S=S):
            qkv = rand(g, B, S, (H + 2 * HKV) * D, dtype=dtype)  # [B, S, (H+2Hkv)D], as the fused linear writes
            q = qkv[..., : H * D].view(B, S, H, D).transpose(1, 2)
            k = qkv[..., H * D : (H + HKV) * D].view(B, S, HKV, D).transpose(1, 2)
            pos = torch.arange(S, device=DEVICE).float() + torch.randint(
                0, 8192 - S + 1, (B, 1), generator=g, device=DEVICE
            )
            inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
            ang = torch.cat([pos[..., None] * inv] * 2, -1)  # [B, S, D]
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
            return ROT.rotary_triton(q, k, cos, sin), ROT.rotary_reference(q, k, cos, sin)

        out[f"rotary B={B} S={S} H={H}/{HKV} D={D}"] = rotary
    V = s(128256, 98)  # Llama-3's vocabulary, split over 2 ranks: rank 1's rows
    w_emb = {}
    for B, S in ((1, 1), (64, 1), (2, s(2048, 5))):

        def vocab_embedding(g, B=B, S=S):
            if "w" not in w_emb:  # one [V/2, E] table (0.5 GB in bf16) for every case
                w_emb["w"] = rand(g, V // 2, E, dtype=dtype)
            ids = torch.randint(0, V, (B, S), generator=g, device=DEVICE)
            start = torch.tensor([V // 2], device=DEVICE)
            return (
                (EMB.vocab_embedding_triton(w_emb["w"], ids, start),),
                (EMB.vocab_embedding_reference(w_emb["w"], ids, start),),
            )

        out[f"vocab_embedding B={B} S={S} rows={V // 2} E={E}"] = vocab_embedding
    return out


def check(got, want) -> dict:
    errs = []
    for a, b in zip(got, want, strict=True):
        if not a.is_contiguous():
            return {"ok": False, "error": "output not contiguous"}
        if not torch.isfinite(a).all():
            return {"ok": False, "error": "non-finite output"}
        errs.append(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0)
        try:
            torch.testing.assert_close(a, b)
        except AssertionError as e:
            # the kernels round once (fp32 math); the 16-bit reference rounds after every op, so
            # on the GPU (FMA contraction) they may differ by an ulp of the result: accept an
            # error within 2 ulps of the largest reference value, nothing more
            tol = 2 * torch.finfo(b.dtype).eps * float(b.float().abs().max()) if b.dtype.is_floating_point else 0
            if errs[-1] > tol:
                return {"ok": False, "error": str(e).splitlines()[0], "max_abs_err": max(errs), "tol": tol}
    return {"ok": True, "max_abs_err": max(errs)}


def check_gelu_erf_accuracy() -> dict:
    """Exact gelu in fp32 on a dense grid of |x| <= 12 against float64 x Phi(x): the erf error it
    implies (output rounding allowed for) within 4e-7, i.e. the polynomial's 1.4e-7 plus up to
    2 ulp of ex2.approx on the GPU (libdevice's erff: 2 ulp, about 1.2e-7 near 1)."""
    x = torch.linspace(-12, 12, 1 << (16 if SMOKE else 24), device=DEVICE)
    y = ACT.gelu_triton(x.view(16, -1), "none").flatten().double()
    x64 = x.double()
    want = x64 * 0.5 * torch.special.erfc(-x64 / 2**0.5)
    big = x.abs() >= 2**-6
    err = float((2 * ((y - want).abs() - 2**-24 * want.abs())[big] / x64[big].abs()).max())
    return {"ok": err <= 4e-7, "max_abs_err": err, **({} if err <= 4e-7 else {"error": f"erf error {err:.3g} > 4e-7"})}


def check_dispatch_and_graphs(dtype) -> dict:
    """The dsc ops run the Triton kernels on CUDA, also from a replayed CUDA graph."""
    if DEVICE != "cuda":
        return {}
    import dsc.kernels.norm  # noqa: F401  (ops registered on import)

    g = torch.Generator(device=DEVICE).manual_seed(1)
    E, I = 4096, 14336
    x, r = rand(g, 8, E, dtype=dtype), rand(g, 8, E, dtype=dtype)
    w = rand(g, E, dtype=dtype)
    gu = rand(g, 8, 2 * I, dtype=dtype)
    qkv = rand(g, 8, 1, 48 * 128, dtype=dtype)
    q = qkv[..., :4096].view(8, 1, 32, 128).transpose(1, 2)
    k = qkv[..., 4096:5120].view(8, 1, 8, 128).transpose(1, 2)
    cs = rand(g, 8, 1, 128, dtype=dtype)
    table, ids, start = (
        rand(g, 1000, E, dtype=dtype),
        torch.randint(0, 2000, (8, 1), generator=g, device=DEVICE),
        torch.tensor([1000], device=DEVICE),
    )
    ops = {
        "add_rmsnorm": (
            lambda: torch.ops.dsc.add_rmsnorm(x, r, w, 1e-5),
            lambda: NORM.add_norm_triton("rms", x, r, w, None, 1e-5),
        ),
        "rmsnorm": (
            lambda: (torch.ops.dsc.rmsnorm(x, w, 1e-5),),
            lambda: NORM.add_norm_triton("rms", x, None, w, None, 1e-5)[1:],
        ),
        "add_layernorm": (
            lambda: torch.ops.dsc.add_layernorm(x, r, w, w, 1e-5),
            lambda: NORM.add_norm_triton("layer", x, r, w, w, 1e-5),
        ),
        "swiglu": (
            lambda: (torch.ops.dsc.swiglu(gu[:, :I], gu[:, I:]),),
            lambda: (ACT.swiglu_triton(gu[:, :I], gu[:, I:]),),
        ),
        "gelu": (lambda: (torch.ops.dsc.gelu(x, "tanh"),), lambda: (ACT.gelu_triton(x, "tanh"),)),
        "rotary": (lambda: torch.ops.dsc.rotary(q, k, cs, cs), lambda: ROT.rotary_triton(q, k, cs, cs)),
        "vocab_embedding": (
            lambda: (torch.ops.dsc.vocab_embedding(table, ids, start),),
            lambda: (EMB.vocab_embedding_triton(table, ids, start),),
        ),
    }
    res = {}
    for name, (op, wrapper) in ops.items():
        dispatch_equal = all(torch.equal(a, b) for a, b in zip(op(), wrapper()))
        for _ in range(2):
            op()  # warm up (JIT) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = op()
        for t in (x, r, gu, qkv):  # new inputs, same buffers
            t.copy_(torch.randn(t.shape, generator=g, device=DEVICE).to(dtype))
        ids.copy_(torch.randint(0, 2000, ids.shape, generator=g, device=DEVICE))
        graph.replay()
        replay_equal = all(torch.equal(a, b) for a, b in zip(outs, wrapper()))
        res[f"dispatch+graph {name}"] = {
            "ok": dispatch_equal and replay_equal,
            "dispatch_equal": dispatch_equal,
            "replay_equal": replay_equal,
        }
    return res


def run_dtype(dtype) -> dict:
    """name -> result of every case at `dtype`, then the dsc ops' dispatch and graph replay."""
    results = {}
    dname = str(dtype).removeprefix("torch.")
    for name, case in cases(dtype).items():
        g = torch.Generator(device=DEVICE).manual_seed(0)
        got, want = case(g)
        results[f"{dname} {name}"] = r = check(got, want)
        print(
            f"{'ok ' if r['ok'] else 'FAIL'} {dname:8s} {name:44s} max|err| {r.get('max_abs_err', float('nan')):.3g}"
            + ("" if r["ok"] else f"  {r['error']}"),
            flush=True,
        )
    for name, r in check_dispatch_and_graphs(dtype).items():
        results[f"{dname} {name}"] = r
        print(f"{'ok ' if r['ok'] else 'FAIL'} {dname:8s} {name}  {r}", flush=True)
    return results


SUMMARY: dict = {}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_kernels_match_references(dtype):
    results = run_dtype(dtype)
    SUMMARY.update(results)
    write_summary("gpu_kernels", {"device": torch.cuda.get_device_name(), "results": SUMMARY})
    assert not [k for k, v in results.items() if not v["ok"]], {k: v for k, v in results.items() if not v["ok"]}


@pytest.mark.gpu
def test_gelu_erf_accuracy():
    r = check_gelu_erf_accuracy()
    assert r["ok"], r


@cpu_smoke
def test_kernels_section_smoke_in_interpreter():
    """This file's code at tiny shapes in the Triton interpreter (fp16; the interpreter's bf16 is emulated)."""
    out = run_smoke(ROOT / "tests" / "gpu" / "test_gpu_kernels.py", "--smoke")
    assert "FAIL" not in out and " passed on cpu" in out


def main() -> int:
    t0 = time.time()
    results = run_dtype(torch.float16)  # smoke: fp16 only (the interpreter's bf16 is emulated)
    results["float32 gelu-none dense grid: implied erf error"] = r = check_gelu_erf_accuracy()
    print(
        f"{'ok ' if r['ok'] else 'FAIL'} float32  gelu-none dense grid: implied erf error {r['max_abs_err']:.3g}",
        flush=True,
    )
    bad = [k for k, v in results.items() if not v["ok"]]
    print(f"{len(results) - len(bad)}/{len(results)} passed on cpu (interpreter) in {time.time() - t0:.1f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    if not SMOKE or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run as: TRITON_INTERPRET=1 python tests/gpu/test_gpu_kernels.py --smoke (on a GPU: pytest tests/gpu)")
    sys.exit(main())
