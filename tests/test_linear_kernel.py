"""The decode GEMV (kernels/linear.py): dsc::linear against F.linear, the GEMV kernel in the
Triton interpreter at small odd shapes (masked and unmasked tiles, bias, fp32 and fp16), its
sm_90 build, the tuning-table choice, and the decode_linears pass; the same for the GEMV fused
with SwiGLU (dsc::linear_swiglu) against the GEMV + swiglu pair.

The kernel cases run in a child process (`python tests/test_linear_kernel.py interpret OUT`):
TRITON_INTERPRET=1 must be set before triton is first imported (tests/kernel_child.py).
"""

from __future__ import annotations

import json
import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from kernel_child import child_fixtures, pdl_check, spill_bytes

from dsc import switches
from dsc.compiler.random_checkpoint import SHAPES
from dsc.errors import UserError
from dsc.kernels import launch
from dsc.kernels import linear as L

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# name: (N, K, bias, config)
KERNEL_CASES = {
    "N47K72-masked": (47, 72, False, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1}),
    "N47K72-bias": (47, 72, True, {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 2}),
    "N48K96-even": (48, 96, False, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1}),
    "N48K96-even-bias-row": (48, 96, True, {"BLOCK_N": 1, "BLOCK_K": 32, "num_warps": 1}),
    "N5K200-long-k": (5, 200, True, {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 1}),
    "N33K16-block-wider-than-k": (33, 16, False, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1}),
    "N47K72-xrow-masked-bias": (47, 72, True, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1, "X_ROW": True}),
    "N48K96-xrow-even": (48, 96, False, {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 1, "X_ROW": True}),
    # EARLY: the first K-blocks as one peeled tile (loaded before the PDL wait on a GPU)
    "N48K128-early2-even": (48, 128, False, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1, "EARLY": 2}),
    "N47K200-early4-masked-bias": (47, 200, True, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1, "EARLY": 4}),
    "N48K96-early3-xrow": (48, 96, False, {"BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 1, "X_ROW": True, "EARLY": 3}),
    "N47K72-early8-past-k": (47, 72, True, {"BLOCK_N": 2, "BLOCK_K": 16, "num_warps": 1, "EARLY": 8}),
}
# name: (outputs N (the weight is [2N, K]), K, config: BLOCK_N counts outputs, each program reads 2 BLOCK_N rows)
SWIGLU_CASES = {
    "N23K72-masked": (23, 72, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1}),
    "N24K96-even": (24, 96, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1}),
    "N5K200-one-output-per-program": (5, 200, {"BLOCK_N": 1, "BLOCK_K": 64, "num_warps": 1}),
    "N23K72-xrow-masked": (23, 72, {"BLOCK_N": 2, "BLOCK_K": 32, "num_warps": 1, "X_ROW": True}),
    "N9K16-block-wider-than-k": (9, 16, {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 1}),
    "N24K128-early4-even": (24, 128, {"BLOCK_N": 2, "BLOCK_K": 32, "num_warps": 1, "EARLY": 4}),
    "N23K200-early2-masked": (23, 200, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1, "EARLY": 2}),
}


def _case(name: str, dtype: torch.dtype) -> dict:
    n, k, bias, cfg = KERNEL_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    x = torch.randn(1, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = L.gemv(x, w, b, cfg)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    try:
        assert got.dtype == dtype and got.shape == (1, n)
        torch.testing.assert_close(got.float(), want, **tol)
    except AssertionError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True}


def _swiglu_case(name: str, dtype: torch.dtype) -> dict:
    """The fused kernel against the pair it replaces, the GEMV kernel (same rows per program,
    the same fp32 sums) and then the swiglu kernel: bit for bit, so each half is rounded to the
    dtype where the pair's linear output is; and against the fp32 reference."""
    from dsc.kernels.activation import swiglu_triton

    n, k, cfg = SWIGLU_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    w = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dtype)  # [gate; up]
    x = torch.randn(1, k, generator=g).to(dtype)
    got = L.gemv_swiglu(x, w, cfg)
    lin = L.gemv(x, w, None, {**cfg, "BLOCK_N": 2 * cfg["BLOCK_N"]})
    pair = swiglu_triton(lin[..., :n], lin[..., n:])
    ref = F.linear(x.float(), w.float())
    want = F.silu(ref[..., :n]) * ref[..., n:]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    try:
        assert got.dtype == dtype and got.shape == (1, n)
        assert torch.equal(got, pair), f"differs from the GEMV + swiglu pair at {(got != pair).nonzero().tolist()}"
        torch.testing.assert_close(got.float(), want, **tol)
    except AssertionError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True}


def run_interpreted(out: str) -> None:
    res = {f"{name}-{d}": _case(name, dt) for name in KERNEL_CASES for d, dt in DTYPES.items()}
    res.update({f"swiglu-{name}-{d}": _swiglu_case(name, dt) for name in SWIGLU_CASES for d, dt in DTYPES.items()})
    Path(out).write_text(json.dumps(res, indent=1))


def _aot(name: str, fn, types: dict, n: int, k: int, config: dict, const: dict, res: dict) -> None:
    """Build fn for sm_90 at `config` over n outputs (EVEN as linear.gemv_launch sets it), with and
    without PDL, specialized as a launch is: pointers, n and k (multiples of 16 in every case
    here) aligned; an unspecialized build has scalar loads, and its masked variant spills."""
    cfg = {"X_ROW": False, **config}
    warps = cfg.pop("num_warps")
    cfg["EARLY_K"] = L.early_columns(cfg.pop("EARLY", 1), cfg["BLOCK_K"], k)  # as gemv_launch converts it
    even = n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0
    for pdl in (False, True):
        kern = launch.compile_for_arch(
            fn, types, {**const, "EVEN": even, **cfg, "PDL": pdl}, num_warps=warps, aligned=tuple(types)
        )
        ptx = kern.asm.get("ptx", "")
        res[name + ("-pdl" if pdl else "")] = {
            "ok": bool(kern.asm.get("cubin")),
            "even": even,
            "spill_bytes": spill_bytes(kern),
            "vector_loads": "ld.global.L1::no_allocate.L2::evict_first.v4" in ptx
            or "ld.global.L2::evict_first.v4" in ptx
            or ".v4.b32" in ptx,
            "pdl": pdl_check(kern, pdl, frozenset({"load w", "load we"})),
        }


def run_aot(out: str) -> None:
    """The GEMV at Llama-8B's o_proj and GPT-2-XL's c_attn shapes, and the GEMV + swiglu at
    Llama-8B's tp=2 gate_up ([14336, 4096]: its GEMV row's one row per program -> one output, a
    2-row tile) and a shape masked along K, built for sm_90 (no GPU), each also with PDL
    (kernels/launch.py): only the first weight tile may load before the wait (with EARLY, the
    peeled tile of several K-blocks: a GEMV and a GEMV + swiglu)."""
    res = {}
    for name, dtype, n, k, bias, cfg in (
        ("bf16-even", "*bf16", 4096, 4096, False, {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4}),
        ("fp16-bias-masked", "*fp16", 4800, 1600, True, {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}),
        ("bf16-xrow", "*bf16", 4096, 4096, False, {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "X_ROW": True}),
        # the tp=2 down_proj's row: 8 K-blocks (2048 columns) before the wait
        ("bf16-early", "*bf16", 4096, 7168, False, L.gemv_config(4096, 7168, "sm_90")),
    ):
        _aot(
            name,
            L._gemv_kernel,
            {"X": dtype, "W": dtype, "B": dtype, "Y": dtype, "N": "i32", "K": "i32"},
            n,
            k,
            cfg,
            {"HAS_BIAS": bias},
            res,
        )
    # the table's config for Llama-8B's tp=2 gate_up [14336, 4096] (7168 outputs)
    for name, dtype, n, k, cfg in (
        ("swiglu-bf16-even", "*bf16", 7168, 4096, L.gemv_swiglu_config(14336, 4096, "sm_90")),
        ("swiglu-fp16-masked", "*fp16", 2752, 1600, {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "X_ROW": True}),
        # half of K before the wait at the tp=4 gate_up's row
        ("swiglu-bf16-early", "*bf16", 3584, 4096, {**L.gemv_swiglu_config(7168, 4096, "sm_90"), "EARLY": 4}),
    ):
        _aot(
            name,
            L._gemv_swiglu_kernel,
            {"X": dtype, "W": dtype, "Y": dtype, "N": "i32", "K": "i32"},
            n,
            k,
            cfg,
            {},
            res,
        )
    Path(out).write_text(json.dumps(res, indent=1))


interpreted, compiled = child_fixtures(__file__, "gemv")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_gemv_matches_f_linear_in_interpreter(case, dtype, interpreted):
    r = interpreted[f"{case}-{dtype}"]
    assert r["ok"], r.get("error")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(SWIGLU_CASES))
def test_gemv_swiglu_matches_the_gemv_swiglu_pair_in_interpreter(case, dtype, interpreted):
    r = interpreted[f"swiglu-{case}-{dtype}"]
    assert r["ok"], r.get("error")


def test_gemv_compiles_for_sm90_with_vector_loads(compiled):
    assert compiled and all(v["ok"] for v in compiled.values()), compiled
    for name in ("bf16-even", "swiglu-bf16-even"):
        assert compiled[name]["even"] and compiled[name]["vector_loads"], compiled


def test_gemv_builds_spill_no_registers(compiled):
    assert all(v["spill_bytes"] == 0 for v in compiled.values()), compiled


def test_gemv_pdl_variant_waits_before_reading_x(compiled):
    """PDL=True: launch_dependents and wait in the PTX, only the weight tile loaded before the
    wait (or the EARLY tile); PDL=False: no griddepcontrol instruction at all (the GEMV's four
    builds and the GEMV + swiglu's three)."""
    assert sum(name.endswith("-pdl") for name in compiled) == 7, compiled
    assert all(v["pdl"] == "ok" for v in compiled.values()), compiled


def test_gemv_rejects_what_it_cannot_run():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="one row"):
        L.gemv(torch.zeros(2, 16), w, None, {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 1})
    with pytest.raises(ValueError, match="contiguous"):
        L.gemv(torch.zeros(1, 16), torch.zeros(16, 8).t(), None, {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 1})
    with pytest.raises(ValueError, match="bias"):
        L.gemv(torch.zeros(1, 16), w, torch.zeros(7), {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 1})


def test_linear_op_is_f_linear_on_cpu_and_passes_opcheck():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(torch.ops.dsc.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.dsc.linear(x, w), F.linear(x, w), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.dsc.linear.default, (x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_swiglu_op_is_the_linear_swiglu_pair_on_cpu(dtype):
    """The op's CPU path (its reference) gives the bits of dsc.linear then dsc.swiglu on the halves."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 5, 24, generator=g).to(dtype), torch.randn(2 * 37, 24, generator=g).to(dtype)
    y = torch.ops.dsc.linear(x, w)
    got = torch.ops.dsc.linear_swiglu(x, w)
    assert got.shape == (3, 5, 37) and torch.equal(got, torch.ops.dsc.swiglu(y[..., :37], y[..., 37:]))
    torch.library.opcheck(torch.ops.dsc.linear_swiglu.default, (x, w))


def test_gemv_swiglu_rejects_what_it_cannot_run():
    cfg = {"BLOCK_N": 2, "BLOCK_K": 16, "num_warps": 1}
    with pytest.raises(ValueError, match="one row"):
        L.gemv_swiglu(torch.zeros(2, 16), torch.zeros(8, 16), cfg)
    with pytest.raises(ValueError, match="even number of rows"):
        L.gemv_swiglu(torch.zeros(1, 16), torch.zeros(7, 16), cfg)


def test_gemv_swiglu_config_follows_the_gemv_row(monkeypatch):
    """Half the GEMV row's BLOCK_N (a program reads gate and up rows: the same tile), at least 1;
    a gemv_swiglu row overrides; none without a GEMV row or with DSC_GEMV=off. The plan: one
    launch where fused, else the linear's kernel and swiglu's."""
    table = {
        "sm_90": {
            "gemv": {
                "N4096_K1024": {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 1, "us": 1, "cublas_us": 2},
                "N28672_K4096": {"BLOCK_N": 1, "BLOCK_K": 2048, "num_warps": 8, "us": 1, "cublas_us": 2},
                "N2048_K512": {"BLOCK_N": 2, "BLOCK_K": 128, "num_warps": 1, "us": 1, "cublas_us": 2},
            },
            "gemv_swiglu": {"N2048_K512": {"BLOCK_N": 4, "num_warps": 2, "us": 1}},
        }
    }
    monkeypatch.setattr(L, "tuning_table", lambda: table)
    assert L.gemv_swiglu_config(4096, 1024, "sm_90") == {"BLOCK_N": 2, "BLOCK_K": 128, "num_warps": 1}
    assert L.gemv_swiglu_config(28672, 4096, "sm_90") == {"BLOCK_N": 1, "BLOCK_K": 2048, "num_warps": 8}
    assert L.gemv_swiglu_config(2048, 512, "sm_90") == {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 2}
    assert L.gemv_swiglu_config(4096, 2048, "sm_90") is None and L.gemv_swiglu_config(4096, 1024, "default") is None
    x = torch.empty(1, 1024)
    p = L._plan_linear_swiglu(x, torch.empty(4096, 1024), arch="sm_90")
    assert p["name"] == "triton.gemv_swiglu" and p["launches"] == 1 and p["config"]["BLOCK_N"] == 2
    p = L._plan_linear_swiglu(x, torch.empty(352, 1024), arch="sm_90")
    assert p["name"] == "cublas.gemm + triton.swiglu" and p["launches"] == 2 and p["config"]["swiglu"]["BLOCK"] == 256
    with switches.override(GEMV="off"):
        assert L.gemv_swiglu_config(4096, 1024, "sm_90") is None
        assert L._plan_linear_swiglu(x, torch.empty(4096, 1024), arch="sm_90")["name"] == "triton.gemv_swiglu"


def test_gemv_row_only_where_tuned(monkeypatch):
    """A shape without a tuning row (or only another arch's) plans cuBLAS; a row gives the GEMV
    with its config, one launch even with a bias (cuBLAS at M = 1: two)."""
    table = {
        "sm_90": {"gemv": {"N4096_K4096": {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "us": 9.0, "cublas_us": 10.7}}}
    }
    monkeypatch.setattr(launch, "tuning_table", lambda: table)
    monkeypatch.setattr(L, "tuning_table", lambda: table)
    assert L.gemv_config(4096, 4096, "sm_90") == {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4}
    assert L.gemv_config(4096, 4096, "default") is None and L.gemv_config(4096, 1024, "sm_90") is None
    x, w, b = torch.empty(1, 4096), torch.empty(4096, 4096), torch.empty(4096)
    p = L._plan_linear(x, w, b, arch="sm_90")
    assert p["name"] == "triton.gemv" and p["launches"] == 1 and p["config"]["BLOCK_K"] == 512
    p = L._plan_linear(x, torch.empty(4096, 1024).t().contiguous(), b, arch="sm_90")
    assert p == {"name": "cublas.gemm", "config": {"N": 1024, "K": 4096, "bias": True}, "launches": 2}


def test_gemv_modes(monkeypatch):
    """DSC_GEMV: off -> cuBLAS even where tuned, all -> a default config where untuned, anything
    else a clear error; the planner plans the tuned choice whatever the variable says."""
    table = {"sm_90": {"gemv": {"N64_K64": {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 1, "us": 1.0, "cublas_us": 2.0}}}}
    monkeypatch.setattr(L, "tuning_table", lambda: table)
    with switches.override(GEMV="off"):
        assert L.gemv_config(64, 64, "sm_90") is None
        assert L._plan_linear(torch.empty(1, 64), torch.empty(64, 64), arch="sm_90")["name"] == "triton.gemv"
    with switches.override(GEMV="all"):
        assert L.gemv_config(48, 96, "sm_90") == L.default_gemv_config(96)
        assert L._plan_linear(torch.empty(1, 96), torch.empty(48, 96), arch="sm_90")["name"] == "cublas.gemm"
    monkeypatch.setenv("DSC_GEMV", "fast")
    switches.reload()
    with pytest.raises(UserError, match="^DSC_GEMV: must be one of tuned, off, all, got 'fast'$"):
        L.gemv_config(64, 64, "sm_90")


def test_early_columns():
    """EARLY K-blocks -> the peeled tile's columns: a power of two, at most K, 0 where it would be
    one block (the loop's own first block waits). The shipped tp=2 down_proj row reaches the
    launch as 2048 columns (8 blocks of 256)."""
    assert [L.early_columns(b, 256, 7168) for b in (0, 1, 2, 3, 4, 8, 64)] == [0, 0, 512, 512, 1024, 2048, 4096]
    assert L.early_columns(8, 2048, 4096) == 4096 and L.early_columns(8, 1024, 1024) == 0
    cfg = L.gemv_config(4096, 7168, "sm_90")
    launch_opts = L.gemv_launch(cfg, 4096, 7168, torch.device("cpu"))[1]
    assert cfg["EARLY"] == 8 and launch_opts["EARLY_K"] == 2048 and "EARLY" not in launch_opts
    assert (
        L.gemv_launch({"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 1}, 4096, 7168, torch.device("cpu"))[1]["EARLY_K"]
        == 0
    )


def test_shipped_gemv_rows_beat_cublas():
    """Every row in kernels/tuning.json was written by scripts/tune_gemv.py with both times."""
    rows = launch.tuning_table().get("sm_90", {}).get("gemv", {})
    for shape_class, row in rows.items():
        assert row["us"] < row["cublas_us"], (shape_class, row)
        assert {"BLOCK_N", "BLOCK_K", "num_warps"} <= set(row), (shape_class, row)


def test_shipped_int8_gemv_rows_hold_only_launch_options():
    """int8_config passes a row's every key to the kernel: a timing kept in a row breaks the launch."""
    allowed = {"BLOCK_N", "BLOCK_K", "PREFETCH", "FAST_CVT", "num_warps", "num_stages", "X_ROW"}
    rows = launch.tuning_table().get("sm_90", {}).get("w8a16_gemv", {})
    assert rows and all(set(r) <= allowed for r in rows.values()), rows


def test_decode_linears_rewrites_only_decode_16bit_linears(compile_artifact):
    art = compile_artifact("llama-tiny", dtype="fp16", max_batch=2, max_seq=64)
    plan = json.loads((art / "plan.json").read_text())
    ops = {p: [n.get("op") for n in plan["programs"][p]["nodes"]] for p in ("prefill", "decode")}
    assert "dsc.linear.default" not in ops["prefill"] and "aten.linear.default" in ops["prefill"]
    assert "aten.linear.default" not in ops["decode"]
    gemvs = ops["decode"].count("dsc.linear.default") + ops["decode"].count("dsc.linear_swiglu.default")
    assert gemvs == ops["prefill"].count("aten.linear.default")
    counters = json.loads((art / "manifest.json").read_text())["passes"]
    assert counters["decode_linears.gemv"] == gemvs > 0


def _ops(art: Path, program: str) -> list[str]:
    plan = json.loads((art / "plan.json").read_text())
    return [n["op"] for n in plan["programs"][program]["nodes"] if n["kind"] == "call"]


@pytest.mark.parametrize("shape, tp", [("llama-tiny", 1), ("llama-tiny", 2), ("phi3-tiny", 1)])
def test_decode_linears_fuses_gate_up_and_swiglu(shape, tp, compile_artifact):
    """16-bit Llama: every layer's decode gate_up GEMV and its swiglu become one
    dsc.linear_swiglu over the rank's [gate; up] weight (tp=2: half of each); prefill keeps
    the linear, the slices and the swiglu. Phi-3 (its checkpoint's gate_up_proj, halved by
    chunk) fuses the same way."""
    art = compile_artifact(shape, dtype="fp16", tp=tp)
    plan = json.loads((art / "plan.json").read_text())
    layers, inter = plan["model"]["layers"], SHAPES[shape][1]["intermediate_size"]
    assert plan["passes"]["decode_linears.swiglu"] == layers
    decode = {n["name"]: n for n in plan["programs"]["decode"]["nodes"]}
    fused = [n for n in decode.values() if n.get("op") == "dsc.linear_swiglu.default"]
    assert len(fused) == layers and "dsc.swiglu.default" not in _ops(art, "decode")
    for n in fused:
        weight = decode[n["args"][1]["node"]]
        assert weight["target"].endswith("mlp.gate_up_proj.weight") and weight["shape"][0] == 2 * inter // tp
        assert n["shape"][-1] == inter // tp and n["kernel"]["launches"] == 2  # tiny shapes: no tuned GEMV
    prefill = _ops(art, "prefill")
    assert prefill.count("dsc.swiglu.default") == layers and "dsc.linear_swiglu.default" not in prefill


@pytest.mark.parametrize(
    "options",
    [{"dtype": "fp32"}, {"dtype": "fp16", "fuse": False}, {"dtype": "fp16", "int8": True, "int8_mode": "w8a8"}],
    ids=["fp32", "no-fuse", "w8a8"],
)
def test_decode_linears_leaves_other_mlps_alone(options, compile_artifact):
    """fp32 (no dsc.linear), --no-fuse (no dsc.swiglu) and W8A8 (dsc.linear_w8a8): nothing to fuse."""
    art = compile_artifact("llama-tiny", **options)
    assert "decode_linears.swiglu" not in json.loads((art / "plan.json").read_text())["passes"]
    assert not {"dsc.linear_swiglu.default", "dsc.linear_w8a16_swiglu.default"} & set(_ops(art, "decode"))


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_linears_fuses_int8_gate_up_and_row_parallel_linears(tp, compile_artifact):
    """--int8 (W8A16): every layer's decode gate_up and its swiglu become one
    dsc.linear_w8a16_swiglu over the rank's int8 [gate; up] rows, and at tp=2 o_proj / down_proj
    and the all-reduce + add + RMSNorm after each one dsc.linear_w8a16_all_reduce_add_rmsnorm: 5
    launches per layer (qkv, attention, o_proj, gate_up, down_proj), as 16-bit. Prefill keeps the
    W8A16 linears, the slices and the swiglu; the scales and zero points go along unchanged."""
    art = compile_artifact("llama-tiny", dtype="fp16", tp=tp, int8=True, int8_group_size=8)
    plan = json.loads((art / "plan.json").read_text())
    layers, inter = plan["model"]["layers"], SHAPES["llama-tiny"][1]["intermediate_size"]
    assert plan["passes"]["decode_linears.swiglu"] == layers
    decode = {n["name"]: n for n in plan["programs"]["decode"]["nodes"]}
    fused = [n for n in decode.values() if n.get("op") == "dsc.linear_w8a16_swiglu.default"]
    assert len(fused) == layers and "dsc.swiglu.default" not in _ops(art, "decode")
    for n in fused:
        qweight, scale = (decode[a["node"]] for a in n["args"][1:3])
        assert qweight["target"].endswith("mlp.gate_up_proj.weight.qweight") and qweight["shape"] == [
            2 * inter // tp,
            64,
        ]
        assert scale["target"].endswith("mlp.gate_up_proj.weight.scale") and scale["shape"] == [2 * inter // tp, 8]
        assert n["args"][4] == 8 and n["shape"][-1] == inter // tp
        assert n["kernel"]["name"] == "triton.w8a16_gemv_swiglu" and n["kernel"]["launches"] == 1
    pushed = [n for n in decode.values() if n.get("op") == "dsc.linear_w8a16_all_reduce_add_rmsnorm.default"]
    assert len(pushed) == (2 * layers if tp > 1 else 0)
    assert plan["passes"].get("decode_linears.all_reduce", 0) == len(pushed)
    for n in pushed:
        assert decode[n["args"][2]["node"]]["target"].endswith(("o_proj.weight.qweight", "down_proj.weight.qweight"))
        assert n["kernel"]["name"] == "triton.w8a16_gemv_push_add_rmsnorm" and n["kernel"]["launches"] == 1
    assert _ops(art, "decode").count("dsc.linear_w8a16.default") == layers * (1 if tp > 1 else 3)  # qkv (o, down)
    prefill = _ops(art, "prefill")
    assert prefill.count("dsc.swiglu.default") == layers and prefill.count("dsc.linear_w8a16.default") == 4 * layers


def _gate_up_graph(
    rows: int = 16,
    gate=(-1, 0, 8),
    up=(-1, 8, 16),
    bias: bool = False,
    swap: bool = False,
    linear_out: bool = False,
    slice_out: bool = False,
    chunk=None,
    chunk_out: bool = False,
):
    """A decode Model of y = dsc.linear(x, W[rows, 8][, b]); swiglu(y[gate], y[up]) (slice args:
    dim, start, end[, step]); swap: swiglu(up, gate); *_out: the linear / the gate half / the
    chunk also an output. chunk=(parts, dim): the halves are chunk(y, parts, dim)[0] and [1]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsc.compiler.ir import Model, infer_val

    mode = FakeTensorMode()
    g = fx.Graph()
    x, w, b = g.placeholder("x"), g.get_attr("mlp.gate_up_proj.weight"), g.get_attr("mlp.gate_up_proj.bias")
    for node, shape in ((x, (2, 1, 8)), (w, (rows, 8)), (b, (rows,))):
        node.meta["val"] = mode.from_tensor(torch.empty(shape, dtype=torch.float16))

    def call(target, *args):
        n = g.call_function(target, args)
        infer_val(n)
        return n

    y = call(torch.ops.dsc.linear.default, x, w, *([b] if bias else []))
    if chunk is None:
        halves = [call(torch.ops.aten.slice.Tensor, y, *s) for s in (gate, up)]
    else:
        pieces = call(torch.ops.aten.chunk.default, y, *chunk)
        halves = [call(operator.getitem, pieces, i) for i in (0, 1)]
    out = call(torch.ops.dsc.swiglu.default, *(halves[::-1] if swap else halves))
    g.output((out, *([y] if linear_out else []), *([halves[0]] if slice_out else []), *([pieces] if chunk_out else [])))
    return Model(programs={"decode": g}, weights={}, config={}, arch=None, options=None, fake_mode=mode)


@pytest.mark.parametrize(
    "case, kw, fires",
    [
        ("halves", {}, True),
        ("halves-dim-2", {"gate": (2, 0, 8), "up": (2, 8, 16, 1)}, True),
        ("not-halves", {"gate": (-1, 0, 7), "up": (-1, 7, 16)}, False),
        ("up-short", {"gate": (-1, 0, 6), "up": (-1, 8, 14)}, False),
        ("strided", {"gate": (-1, 0, 8, 2), "up": (-1, 8, 16, 2)}, False),
        ("other-dim", {"gate": (0, 0, 8), "up": (-1, 8, 16)}, False),
        ("up-first", {"swap": True}, False),
        ("bias", {"bias": True}, False),
        ("linear-read-elsewhere", {"linear_out": True}, False),
        ("slice-read-elsewhere", {"slice_out": True}, False),
        # Phi-3: chunk(y, 2, -1)
        ("chunk", {"chunk": (2, -1)}, True),
        ("chunk-dim-2", {"chunk": (2, 2)}, True),
        ("chunk-3", {"chunk": (3, -1), "rows": 24}, False),
        ("chunk-other-dim", {"chunk": (2, 0), "rows": 16}, False),
        ("chunk-up-first", {"chunk": (2, -1), "swap": True}, False),
        ("chunk-read-elsewhere", {"chunk": (2, -1), "chunk_out": True}, False),
        ("chunk-half-read-elsewhere", {"chunk": (2, -1), "slice_out": True}, False),
        ("chunk-bias", {"chunk": (2, -1), "bias": True}, False),
    ],
)
def test_decode_linears_swiglu_rule_is_strict(case, kw, fires):
    """Only swiglu(gate half, up half) of a bias-free dsc.linear that nothing else reads."""
    from dsc.passes.decode_linears import decode_linears

    model = decode_linears(_gate_up_graph(**kw))
    ops = [n.target for n in model.programs["decode"].nodes if n.op == "call_function"]
    assert (model.counters["decode_linears.swiglu"] == 1) == fires, ops
    if fires:
        assert ops == [torch.ops.dsc.linear_swiglu.default]
        out = next(n for n in model.programs["decode"].nodes if n.op == "call_function")
        assert out.meta["val"].shape == (2, 1, 8) and out.meta["val"].dtype == torch.float16
    else:
        assert torch.ops.dsc.linear_swiglu.default not in ops and torch.ops.dsc.swiglu.default in ops


@pytest.mark.parametrize("int8", [False, True])
def test_tune_gemv_script_runs_its_code_path(tmp_path, int8):
    """scripts/tune_gemv.py --smoke in the interpreter: one tiny shape, both GEMVs, outputs written
    (the timings are meaningless on CPU; the GPU run is what writes kernels/tuning.json)."""
    import os
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "tune_gemv.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--smoke",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            *(["--int8"] if int8 else []),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads((tmp_path / "tuning.json").read_text())
    assert table["default"]["w8a16_gemv" if int8 else "gemv"] is not None
    res = json.loads((tmp_path / ("tune_gemv_int8.json" if int8 else "tune_gemv.json")).read_text())
    assert res["device"] == "cpu" and len(res["results"]) == 1


if __name__ == "__main__":
    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])
