"""The fused Triton kernels (kernels/norm.py, activation.py, rotary.py, embedding.py) against their
plain-torch references, on CPU in the Triton interpreter, at small odd shapes, fp32 and fp16;
and every kernel compiled ahead of time for sm_90 (Triton builds the cubin without a GPU).

TRITON_INTERPRET=1 must be set before the first kernel is jitted, and other tests may have
imported triton already, so the cases run in one subprocess: this file run as a script,
`python tests/test_fused_kernels.py interpret OUT.json` (or `aot OUT.json`), writes one
result per case; each test reads its own. bf16 is left to tests/gpu/test_gpu_kernels.py: the
interpreter emulates bf16 (its arithmetic is not the GPU's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from kernel_child import child_fixtures, pdl_check

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


# -- cases: name -> fn(dtype, gen) -> (got, want), got from the Triton wrapper -------------------
def _t(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


def _norm(kind, shape, residual, bias, noncontig=False, x_bias=False):
    def case(dt, g):
        from dsc.kernels import norm

        n = shape[-1]
        x = _t(g, *shape, dtype=dt)
        if noncontig:  # [.., n] rows that do not collapse: a transposed view
            x = _t(g, *reversed(shape[:-1]), n, dtype=dt).transpose(0, 1)
        r = _t(g, *shape, dtype=dt) if residual else None
        w = (1 + 0.1 * _t(g, n, dtype=torch.float32)).to(dt)
        b = _t(g, n, dtype=dt) if bias else None
        eps = 1e-6 if kind == "rms" else 1e-5
        xb = _t(g, n, dtype=dt) if x_bias else None
        s, y = norm.add_norm_triton(kind, x, r, w, b, eps, x_bias=xb)
        if kind == "rms":
            want = norm.add_rmsnorm_reference(x, r, w, eps) if residual else (None, norm.rmsnorm_reference(x, w, eps))
        else:
            want = norm.add_layernorm_reference(x, r, w, b, eps, xb)
        return [t for t in (s, y) if t is not None], [t for t in want if t is not None]

    return case


def _swiglu(shape, fused):
    def case(dt, g):
        from dsc.kernels import activation

        n = shape[-1]
        if fused:  # the slices of one gate_up output, read in place
            gu = _t(g, *shape[:-1], 2 * n, dtype=dt)
            gate, up = gu[..., :n], gu[..., n:]
        else:
            gate, up = _t(g, *shape, dtype=dt), _t(g, *shape, dtype=dt)
        return [activation.swiglu_triton(gate, up)], [activation.swiglu_reference(gate, up)]

    return case


def _gelu(shape, approximate, bias=False):
    def case(dt, g):
        from dsc.kernels import activation

        x = 3 * _t(g, *shape, dtype=dt)
        b = _t(g, shape[-1], dtype=dt) if bias else None
        return [activation.gelu_triton(x, approximate, b)], [activation.gelu_reference(x, approximate, b)]

    return case


def _rotary(B, S, HQ, HK, D):
    def case(dt, g):
        from dsc.kernels import rotary

        qkv = _t(g, B, S, (HQ + 2 * HK) * D, dtype=dt)  # the fused projection's output
        q = qkv[..., : HQ * D].view(B, S, HQ, D).transpose(1, 2)  # [B, HQ, S, D], strided
        k = qkv[..., HQ * D : (HQ + HK) * D].view(B, S, HK, D).transpose(1, 2)
        ang = torch.rand(B, S, D // 2, generator=g) * 6
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
        got = rotary.rotary_triton(q, k, cos, sin)
        return list(got), list(rotary.rotary_reference(q, k, cos, sin))

    return case


def _vocab_embedding(B, S, rows, H, block_h):
    def case(dt, g):
        from dsc.kernels import embedding

        w = _t(g, rows, H, dtype=dt)
        start = torch.tensor([7])
        ids = torch.randint(0, 7 + rows + 6, (B, S), generator=g)  # below, inside and above the rank's rows
        edges = torch.tensor([6, 7, 7 + rows - 1, 7 + rows])[: ids.numel()]  # each side of both edges
        ids.view(-1)[: edges.numel()] = edges
        got = embedding.vocab_embedding_triton(w, ids, start, {"BLOCK_H": block_h, "num_warps": 2})
        return [got], [embedding.vocab_embedding_reference(w, ids, start)]

    return case


CASES = {
    "rmsnorm-7x72": _norm("rms", (7, 72), residual=False, bias=False),
    "add_rmsnorm-7x200": _norm("rms", (7, 200), residual=True, bias=False),
    "add_rmsnorm-3x5x72": _norm("rms", (3, 5, 72), residual=True, bias=False),
    "add_rmsnorm-noncontig-3x5x72": _norm("rms", (3, 5, 72), residual=True, bias=False, noncontig=True),
    "add_rmsnorm-0x72": _norm("rms", (0, 72), residual=True, bias=False),
    "add_layernorm-7x200": _norm("layer", (7, 200), residual=True, bias=True),
    "add_layernorm-nobias-7x72": _norm("layer", (7, 72), residual=True, bias=False),
    "add_layernorm-xbias-7x200": _norm("layer", (7, 200), residual=True, bias=True, x_bias=True),
    "add_layernorm-xbias-noncontig-3x5x72": _norm(
        "layer", (3, 5, 72), residual=True, bias=True, x_bias=True, noncontig=True
    ),
    "swiglu-fused-3x5x200": _swiglu((3, 5, 200), fused=True),
    "swiglu-7x72": _swiglu((7, 72), fused=False),
    "gelu-erf-7x200": _gelu((7, 200), "none"),
    "gelu-tanh-2x3x72": _gelu((2, 3, 72), "tanh"),
    "gelu-tanh-bias-2x3x72": _gelu((2, 3, 72), "tanh", bias=True),
    "gelu-erf-bias-7x200": _gelu((7, 200), "none", bias=True),
    "rotary-prefill-B2S3-H6/2-D12": _rotary(2, 3, 6, 2, 12),
    "rotary-decode-B3S1-H4/2-D16": _rotary(3, 1, 4, 2, 16),
    "rotary-B1S5-H5/1-D72": _rotary(1, 5, 5, 1, 72),
    "vocab_embedding-B3S5-11x200": _vocab_embedding(3, 5, 11, 200, 64),  # 4 column blocks, the last partial
    "vocab_embedding-B4S1-5x72": _vocab_embedding(4, 1, 5, 72, 128),
}


def gelu_erf_accuracy() -> dict:
    """The erf-free exact gelu (activation.py's docstring) on a dense fp32 grid of |x| <= 12
    against float64 x Phi(x): the erf error it implies once the output's own rounding is
    allowed for, 2 (|y - x Phi| - 2^-24 |x Phi|) / |x|; Phi's relative error in the negative tail
    down to x = -8; and non-finite / huge inputs."""
    from dsc.kernels import activation

    x = torch.linspace(-12, 12, 1 << 21, dtype=torch.float32)  # step 1.1e-5
    y = activation.gelu_triton(x.view(32, -1), "none", config={"BLOCK": 1 << 16, "num_warps": 4}).flatten()
    x64, y64 = x.double(), y.double()
    want = x64 * 0.5 * torch.special.erfc(-x64 / 2**0.5)  # [N] float64
    big = x.abs() >= 2**-6
    erf_err = 2 * ((y64 - want).abs() - 2**-24 * want.abs())[big] / x64[big].abs()
    tail = (x >= -8) & (x <= -1)
    tail_rel = ((y64 - want).abs() / want.abs())[tail]
    edge = torch.tensor(
        [-float("inf"), -1e30, -100.0, -9.0, -0.0, 0.0, 1e-30, 9.0, 100.0, 1e30, float("inf"), float("nan")]
    )
    edge_want = edge.double() * 0.5 * torch.special.erfc(-edge.double() / 2**0.5)  # gelu(-inf) = -inf * 0 = nan
    edge_ok = bool(
        torch.isclose(
            activation.gelu_triton(edge, "none").double(), edge_want, rtol=1e-6, atol=1e-17, equal_nan=True
        ).all()
    )
    return {"erf_max_abs_err": float(erf_err.max()), "tail_max_rel_err": float(tail_rel.max()), "edge_ok": edge_ok}


def run_interpreted(out: str) -> None:
    results = {"gelu-erf-accuracy": gelu_erf_accuracy()}
    for name, case in CASES.items():
        for dname, dt in DTYPES.items():
            g = torch.Generator().manual_seed(0)
            got, want = case(dt, g)
            try:
                for a, b in zip(got, want, strict=True):
                    assert a.is_contiguous(), "output not contiguous"
                    torch.testing.assert_close(a, b)
                err = max((float((a.float() - b.float()).abs().max()) if a.numel() else 0.0) for a, b in zip(got, want))
                results[f"{name}-{dname}"] = {"ok": True, "max_abs_err": err}
            except AssertionError as e:
                results[f"{name}-{dname}"] = {"ok": False, "error": str(e)}
    Path(out).write_text(json.dumps(results, indent=1))


# -- ahead-of-time compilation for sm_90: kernel, runtime argument types, constexprs, warps --------
def aot_cases():
    from dsc.kernels import activation, embedding, norm, rotary

    ptr = lambda names, ty: {n: ty for n in names.split()}  # noqa: E731
    ints = lambda names: {n: "i32" for n in names.split()}  # noqa: E731
    out = {}
    for ty in ("*bf16", "*fp16"):
        t = ty[1:]
        norm_args = {**ptr("X R W S Y", ty), **ints("stride_x stride_r stride_s stride_y N"), "eps": "fp32"}
        out[f"rmsnorm-{t}"] = (norm._rmsnorm_kernel, norm_args, dict(HAS_RESIDUAL=False, BLOCK_N=4096), 8)
        out[f"add_rmsnorm-{t}"] = (norm._rmsnorm_kernel, norm_args, dict(HAS_RESIDUAL=True, BLOCK_N=4096), 8)
        ln_args = {**ptr("X R W B XB S Y", ty), **ints("stride_x stride_r stride_s stride_y N"), "eps": "fp32"}
        for xb in (False, True):
            out[f"add_layernorm{'-xbias' if xb else ''}-{t}"] = (
                norm._layernorm_kernel,
                ln_args,
                dict(HAS_RESIDUAL=True, HAS_BIAS=True, HAS_XBIAS=xb, BLOCK_N=2048),
                8,
            )
        out[f"swiglu-{t}"] = (
            activation._swiglu_kernel,
            {**ptr("G U Y", ty), **ints("stride_g stride_u stride_y N")},
            dict(BLOCK=1024),
            4,
        )
        for approx in (False, True):
            for bias in (False, True):
                out[f"gelu-{'tanh' if approx else 'erf'}{'-bias' if bias else ''}-{t}"] = (
                    activation._gelu_kernel,
                    {**ptr("X B Y", ty), **ints("stride_x stride_y N")},
                    dict(APPROX_TANH=approx, HAS_BIAS=bias, BLOCK=1024),
                    4,
                )
        rot_args = {
            **ptr("Q K COS SIN QO KO", ty),
            **ints("sq_b sq_h sq_s sk_b sk_h sk_s sc_b sc_s ss_b ss_s S HQ HK HALF"),
        }
        out[f"rotary-{t}"] = (rotary._rotary_kernel, rot_args, dict(BLOCK_H=8, BLOCK_D=64), 4)
        out[f"vocab_embedding-{t}"] = (
            embedding._vocab_embedding_kernel,
            {"W": ty, "IDS": "*i64", "START": "*i64", "OUT": ty, **ints("rows H")},
            dict(BLOCK_H=1024),
            4,
        )
    # every kernel also with PDL (kernels/launch.py): griddepcontrol.wait before any memory access
    return {
        **out,
        **{
            f"{name}-pdl": (fn, types, {**const, "PDL": True}, warps) for name, (fn, types, const, warps) in out.items()
        },
    }


def run_aot(out: str) -> None:
    from dsc.kernels.launch import compile_for_arch

    results = {}
    for name, (fn, types, constexprs, warps) in aot_cases().items():
        k = compile_for_arch(fn, types, constexprs, num_warps=warps)
        results[name] = {
            "ok": bool(k.asm.get("cubin")),
            "cubin_bytes": len(k.asm.get("cubin", b"")),
            "pdl": pdl_check(k, constexprs.get("PDL", False)),
        }
    Path(out).write_text(json.dumps(results, indent=1))


# -- tests ------------------------------------------------------------------------------------------
interpreted, compiled = child_fixtures(__file__, "kernels")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_in_interpreter(case, dtype, interpreted):
    r = interpreted[f"{case}-{dtype}"]
    assert r["ok"], r.get("error")


def test_gelu_erf_accuracy(interpreted):
    """The polynomial erf: within 2e-7 of float64 erf (libdevice's erff: 2 ulp), and better than
    torch's 1 + erf (which cancels) in the negative tail."""
    r = interpreted["gelu-erf-accuracy"]
    assert r["erf_max_abs_err"] <= 2e-7 and r["tail_max_rel_err"] <= 1e-3 and r["edge_ok"], r


def test_kernels_compile_for_sm90(compiled):
    bad = {k: v for k, v in compiled.items() if not v["ok"]}
    assert compiled and not bad, bad


def test_pdl_variants_wait_before_any_memory_access(compiled):
    assert sum(name.endswith("-pdl") for name in compiled) * 2 == len(compiled), list(compiled)
    bad = {k: v["pdl"] for k, v in compiled.items() if v["pdl"] != "ok"}
    assert not bad, bad


def test_plan_configs_come_from_the_tuning_table():
    """What plan_kernels records for sm_90 is the tuning table's entry (scripts/tune_kernels.py)."""
    from dsc.kernels.activation import elementwise_config
    from dsc.kernels.launch import tuning_table
    from dsc.kernels.norm import norm_config
    from dsc.kernels.rotary import rotary_config

    table = tuning_table()["sm_90"]
    assert norm_config("add_rmsnorm", 4096, "sm_90") == {"BLOCK_N": 4096, **table["add_rmsnorm"]["N4096"]}
    assert elementwise_config("swiglu", 14336, "sm_90") == table["swiglu"]["N16384"]
    assert rotary_config(128, "sm_90") == {"BLOCK_D": 64, **table["rotary"]["D128"]}
    assert norm_config("add_rmsnorm", 72, "default")["BLOCK_N"] == 128  # odd widths pad to a power of two


if __name__ == "__main__":
    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])
