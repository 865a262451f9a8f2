"""The decode GEMV (kernels/linear.py): dsc::linear against F.linear, the GEMV kernel in the
Triton interpreter at small odd shapes (masked and unmasked tiles, bias, fp32 and fp16), its
sm_90 build, the tuning-table choice, and the decode_linears pass.

The kernel cases run in a child process (`python tests/test_linear_kernel.py interpret OUT`):
TRITON_INTERPRET=1 must be set before triton is first imported (tests/kernel_child.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_child import child_fixtures, pdl_check

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
}


def _case(name: str, dtype: torch.dtype) -> dict:
    n, k, bias, cfg = KERNEL_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
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


def run_interpreted(out: str) -> None:
    res = {f"{name}-{d}": _case(name, dt) for name in KERNEL_CASES for d, dt in DTYPES.items()}
    Path(out).write_text(json.dumps(res, indent=1))


def run_aot(out: str) -> None:
    """The GEMV at Llama-8B's o_proj and GPT-2-XL's c_attn shapes, built for sm_90 (no GPU), each
    also with PDL (kernels/launch.py), specialized as a launch is (aligned pointers, N and K
    multiples of 16): only the first weight tile may load before the wait."""
    res = {}
    for name, dtype, n, k, bias, cfg in (("bf16-even", "*bf16", 4096, 4096, False,
                                          {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4}),
                                         ("fp16-bias-masked", "*fp16", 4800, 1600, True,
                                          {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}),
                                         ("bf16-xrow", "*bf16", 4096, 4096, False,
                                          {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "X_ROW": True})):
        cfg = {"X_ROW": False, **cfg}
        warps = cfg.pop("num_warps")
        even = n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0
        for pdl in (False, True):
            kern = launch.compile_for_arch(L._gemv_kernel, {"X": dtype, "W": dtype, "B": dtype, "Y": dtype,
                                                            "N": "i32", "K": "i32"},
                                           {"HAS_BIAS": bias, "EVEN": even, **cfg, "PDL": pdl}, num_warps=warps,
                                           aligned=("X", "W", "B", "Y", "N", "K") if pdl else ())
            ptx = kern.asm.get("ptx", "")
            res[name + ("-pdl" if pdl else "")] = {
                "ok": bool(kern.asm.get("cubin")), "even": even,
                "vector_loads": "ld.global.L1::no_allocate.L2::evict_first.v4" in ptx
                or "ld.global.L2::evict_first.v4" in ptx or ".v4.b32" in ptx,
                "pdl": pdl_check(kern, pdl, frozenset({"load w"}))}
    Path(out).write_text(json.dumps(res, indent=1))


interpreted, compiled = child_fixtures(__file__, "gemv")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_gemv_matches_f_linear_in_interpreter(case, dtype, interpreted):
    r = interpreted[f"{case}-{dtype}"]
    assert r["ok"], r.get("error")


def test_gemv_compiles_for_sm90_with_vector_loads(compiled):
    assert compiled and all(v["ok"] for v in compiled.values()), compiled
    assert compiled["bf16-even"]["even"] and compiled["bf16-even"]["vector_loads"], compiled


def test_gemv_pdl_variant_waits_before_reading_x(compiled):
    """PDL=True: launch_dependents and wait in the PTX, only the weight tile loaded before the
    wait; PDL=False: no griddepcontrol instruction at all."""
    assert sum(name.endswith("-pdl") for name in compiled) == 3, compiled
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


def test_gemv_row_only_where_tuned(monkeypatch):
    """A shape without a tuning row (or only another arch's) plans cuBLAS; a row gives the GEMV
    with its config, one launch even with a bias (cuBLAS at M = 1: two)."""
    table = {"sm_90": {"gemv": {"N4096_K4096": {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4,
                                                "us": 9.0, "cublas_us": 10.7}}}}
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
    monkeypatch.setenv("DSC_GEMV", "off")
    assert L.gemv_config(64, 64, "sm_90") is None
    assert L._plan_linear(torch.empty(1, 64), torch.empty(64, 64), arch="sm_90")["name"] == "triton.gemv"
    monkeypatch.setenv("DSC_GEMV", "all")
    assert L.gemv_config(48, 96, "sm_90") == L.default_gemv_config(96)
    assert L._plan_linear(torch.empty(1, 96), torch.empty(48, 96), arch="sm_90")["name"] == "cublas.gemm"
    monkeypatch.setenv("DSC_GEMV", "fast")
    with pytest.raises(ValueError, match="DSC_GEMV must be one of tuned, off, all, got 'fast'"):
        L.gemv_config(64, 64, "sm_90")


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
    assert ops["decode"].count("dsc.linear.default") == ops["prefill"].count("aten.linear.default")
    counters = json.loads((art / "manifest.json").read_text())["passes"]
    assert counters["decode_linears.gemv"] == ops["decode"].count("dsc.linear.default") > 0


@pytest.mark.parametrize("int8", [False, True])
def test_tune_gemv_script_runs_its_code_path(tmp_path, int8):
    """scripts/tune_gemv.py --smoke in the interpreter: one tiny shape, both GEMVs, outputs written
    (the timings are meaningless on CPU; the GPU run is what writes kernels/tuning.json)."""
    import os
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "tune_gemv.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--device", "cpu", "--out", str(tmp_path),
                           *(["--int8"] if int8 else [])], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads((tmp_path / "tuning.json").read_text())
    assert table["default"]["w8a16_gemv" if int8 else "gemv"] is not None
    res = json.loads((tmp_path / ("tune_gemv_int8.json" if int8 else "tune_gemv.json")).read_text())
    assert res["device"] == "cpu" and len(res["results"]) == 1


if __name__ == "__main__":
    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])
