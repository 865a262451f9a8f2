"""`dsc::moe`'s Triton kernels (kernels/fused_moe.py) against `moe_reference` (kernels/moe.py) on
CPU in the Triton interpreter, at small odd sizes (H 40, I 24, 5 local experts, top 2); and the
kernels built ahead of time for sm_90 (no GPU) at the default configs of Mixtral- and
Qwen3-MoE-sized layers, so that what only real hardware compiles is checked here too.

TRITON_INTERPRET=1 must be set before triton is imported, so the cases run in child processes
(tests/kernel_child.py): `python tests/test_moe_kernel.py interpret OUT.json` (or `aot OUT.json`).

Tolerance: max |got - want| / max |want| <= 1e-4 in fp32 and 1e-2 in fp16 (the kernels keep the
reference's rounding points; the fp16 bound allows an intermediate rounded the other way).
bf16 is left to tests/gpu/test_gpu_moe.py (the interpreter emulates bf16).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from kernel_child import child_fixtures

TOL = {torch.float32: 1e-4, torch.float16: 1e-2}
H, I, E, K = 40, 24, 5, 2
# pinned configs (the CPU default is one tile shape): small tiles, partial GROUP_M groups, and
# a down GEMM split 3 ways over I = 24 in K-blocks of 16 (the third split has no K-block)
SPLIT = {
    "gate_up": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 3, "num_warps": 4, "num_stages": 2},
    "down": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 2, "SPLIT_K": 3, "num_warps": 4, "num_stages": 2},
    "combine": {"BLOCK_T": 4, "BLOCK_H": 32, "num_warps": 1},
}
WIDE = {
    "gate_up": {
        "BLOCK_M": 64,
        "BLOCK_N": 32,
        "BLOCK_K": 32,
        "GROUP_M": 8,
        "STREAM_W": False,
        "num_warps": 4,
        "num_stages": 2,
    },
    "down": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2},
    "combine": {"BLOCK_T": 16, "BLOCK_H": 64, "num_warps": 1},
}


def _routing(g, t, experts, first, mode):
    """topk_ids [t, K] (distinct per token), global ids."""
    if mode == "one":  # every token's first choice is local expert 4
        ids = torch.stack([torch.full((t,), 4), torch.randint(0, 4, (t,), generator=g)], 1)
    elif mode == "skip2":  # local expert 2 gets nothing
        pool = torch.tensor([0, 1, 3, 4])
        ids = torch.stack([pool[torch.randperm(4, generator=g)[:K]] for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(t)])
    return ids + (first if mode in ("one", "skip2") else 0)


def _case(
    t,
    dtype,
    *,
    int8=False,
    first=0,
    experts=E,
    mode="random",
    config=None,
    fp32_weights=False,
    strided=False,
    twice=False,
):
    def run(g):
        from dsc.kernels import int8 as Q
        from dsc.kernels.fused_moe import fused_moe_triton
        from dsc.kernels.moe import moe_reference

        x = torch.randn(t, H + (8 if strided else 0), generator=g).to(dtype)
        x = x[:, 3 : H + 3] if strided else x  # rows of stride H + 8
        ids = _routing(g, t, experts, first, mode)
        w = torch.softmax(torch.randn(t, K, generator=g), -1).to(torch.float32 if fp32_weights else dtype)
        gu = torch.randn(E * 2 * I, H, generator=g) / H**0.5
        dn = torch.randn(E * H, I, generator=g) / I**0.5
        if int8:
            qg, qd = Q.quantize_weight(gu), Q.quantize_weight(dn)
            gu, gs, dn, ds = qg["qweight"], qg["scale"].reshape(-1), qd["qweight"], qd["scale"].reshape(-1)
        else:
            gu, dn, gs, ds = gu.to(dtype), dn.to(dtype), None, None
        got = fused_moe_triton(x, ids, w, gu, dn, first, gs, ds, config=config)
        want = moe_reference(x, ids, w, gu, dn, first, gs, ds)
        again = fused_moe_triton(x, ids, w, gu, dn, first, gs, ds, config=config) if twice else None
        return got, want, again

    return run


CASES = {
    "fp32-T1": _case(1, torch.float32),
    "fp32-T37": _case(37, torch.float32),
    "fp16-T37": _case(37, torch.float16),
    "fp16-T3-strided-x-fp32-weights": _case(3, torch.float16, strided=True, fp32_weights=True),
    # expert parallelism: local experts 0-4 are global 3-7 of 12; the other ids add nothing
    "fp32-T37-ep-first3": _case(37, torch.float32, first=3, experts=12),
    "fp16-T1-ep-first3": _case(1, torch.float16, first=3, experts=12),
    "fp32-T37-empty-expert": _case(37, torch.float32, first=2, mode="skip2"),
    "fp16-T37-one-expert": _case(37, torch.float16, mode="one"),  # 37 slots of expert 4: 3 tiles of 16
    "fp32-T13-split-k": _case(13, torch.float32, first=3, experts=12, config=SPLIT, twice=True),
    "fp16-T37-wide-tiles": _case(37, torch.float16, mode="one", config=WIDE),
    "int8-fp32-T37": _case(37, torch.float32, int8=True, twice=True),
    "int8-fp16-T3-ep": _case(3, torch.float16, int8=True, first=3, experts=12),
    "int8-fp16-T13-split-k": _case(13, torch.float16, int8=True, config=SPLIT),
}


def run_interpreted(out: str) -> None:
    results = {}
    for name, case in CASES.items():
        g = torch.Generator().manual_seed(0)
        got, want, again = case(g)
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        tol = TOL[want.dtype]
        results[name] = {
            "ok": bool(err <= tol and got.dtype == want.dtype and torch.isfinite(got).all()),
            "rel_err": err,
            "tol": tol,
        }
        if again is not None:
            results[name]["deterministic"] = bool(torch.equal(got, again))
    Path(out).write_text(json.dumps(results, indent=1))


# -- ahead-of-time builds for sm_90 ----------------------------------------------------------------
AOT_SHAPES = {  # name -> T, H, I, E, K, x type, weight type, kernels built
    "mixtral-T1-bf16": (1, 4096, 14336, 8, 2, "*bf16", "*bf16", "gate_up down combine"),  # down split over I
    "mixtral-T4096-bf16": (4096, 4096, 14336, 8, 2, "*bf16", "*bf16", "gate_up down route"),  # wgmma tiles
    "qwen3-T1-int8-fp16": (1, 2048, 768, 128, 8, "*fp16", "*i8", "gate_up down"),  # narrow column blocks
    "qwen3-T4096-int8": (4096, 2048, 768, 128, 8, "*bf16", "*i8", "gate_up"),
    "qwen3-T16-fp32": (16, 2048, 768, 128, 8, "*fp32", "*fp32", "gate_up"),  # IEEE fp32 products
}


def run_aot(out: str) -> None:
    from dsc.kernels import fused_moe as M
    from dsc.kernels.launch import compile_for_arch

    cuda = torch.device("cuda")  # a device type only: FAST_CVT's inline PTX is built for CUDA
    i32 = lambda names: {n: "i32" for n in names.split()}  # noqa: E731
    res = {}
    for name, (t, h, inter, e, k, xt, wt, kernels) in AOT_SHAPES.items():
        xb, wb = {"*fp32": 4, "*i8": 1}.get(xt, 2), {"*fp32": 4, "*i8": 1}.get(wt, 2)
        cfg = M.moe_config(t, h, inter, e, k, "sm_90", xb, wb)
        split = cfg["down"]["SPLIT_K"]
        yt = "*fp32" if split > 1 else xt
        flags = dict(INT8=wt == "*i8", PRECISION="ieee" if xt == "*fp32" else "tf32", E_P=M.experts_padded(e))
        builds = {
            "gate_up": (
                M._gate_up_kernel,
                {
                    "X": xt,
                    "W": wt,
                    "S": "*fp32",
                    "SORTED": "*i32",
                    "OFFS": "*i32",
                    "ACT": xt,
                    **i32("n_tiles E H I K_TOP stride_x"),
                },
                cfg["gate_up"],
                True,
            ),
            "down": (
                M._down_kernel,
                {"ACT": xt, "W": wt, "S": "*fp32", "OFFS": "*i32", "Y": yt, **i32("n_tiles E H I NP")},
                cfg["down"],
                True,
            ),
            "combine": (
                M._combine_kernel,
                {"Y": yt, "SLOT_ROW": "*i32", "TW": xt, "OUT": xt, **i32("T H K_TOP stride_split stride_out")},
                {"SPLIT_K": split, **cfg["combine"]},
                False,
            ),
            "route": (
                M._route_kernel,
                {"IDS": "*i64", "SORTED": "*i32", "SLOT_ROW": "*i32", "OFFS": "*i32", **i32("N first_expert E")},
                M.route_config(t * k),
                False,
            ),
        }
        for kname in kernels.split():
            fn, types, c, gemm = builds[kname]
            if gemm:
                const, opts = M._options(c, cuda)
                const.update(flags)
            else:
                opts = {"num_warps": c["num_warps"]}
                const = {key: v for key, v in c.items() if key != "num_warps"}
            aligned = tuple(a for a, ty in types.items() if ty.startswith("*") or a in ("H", "I", "stride_x"))
            kern = compile_for_arch(
                fn, types, const, num_warps=opts["num_warps"], num_stages=opts.get("num_stages"), aligned=aligned
            )
            ptx = kern.asm.get("ptx", "")
            res[f"{name}-{kname}"] = {
                "ok": bool(kern.asm.get("cubin")),
                "shared": kern.metadata.shared,
                "tensor_cores": "mma.sync" in ptx or "wgmma" in ptx,
                "gemm": gemm,
                "fp32": xt == "*fp32",
                "fast_cvt": "prmt.b32" in ptx,
                "wants_fast_cvt": bool(c.get("FAST_CVT")),
            }
    Path(out).write_text(json.dumps(res, indent=1))


# -- tests ------------------------------------------------------------------------------------------
interpreted, compiled = child_fixtures(__file__, "moe")


@pytest.mark.parametrize("case", list(CASES))
def test_moe_kernels_match_reference_in_interpreter(case, interpreted):
    r = interpreted[case]
    assert r["ok"], r


def test_moe_kernels_are_deterministic(interpreted):
    """Two calls on the same inputs give the same bits (a stable counting sort, no atomics)."""
    runs = {k: r["deterministic"] for k, r in interpreted.items() if "deterministic" in r}
    assert len(runs) == 2 and all(runs.values()), runs


def test_moe_kernels_compile_for_sm90(compiled):
    """Every kernel at the sm_90 default configs builds, within the 227 KiB of shared memory a block
    may opt into on an H100/H200; 16-bit GEMMs on tensor cores; int8 with the ALU conversion."""
    bad = {k: v for k, v in compiled.items() if not v["ok"] or not 0 <= v["shared"] <= 232448}
    assert len(compiled) == sum(len(v[-1].split()) for v in AOT_SHAPES.values()) and not bad, bad
    assert all(v["tensor_cores"] for v in compiled.values() if v["gemm"] and not v["fp32"]), compiled
    assert all(v["fast_cvt"] == v["wants_fast_cvt"] for v in compiled.values()), compiled
    assert compiled["qwen3-T4096-int8-gate_up"]["fast_cvt"]


def test_planner_records_every_bucket_for_symbolic_tokens():
    """T is symbolic in a traced program: the plan holds the configs at the token counts of
    PLAN_BUCKETS, from the static dims only (dim 0 here is an object any use of which raises), and
    counts the four launches."""
    from types import SimpleNamespace as NS

    import dsc.kernels.moe  # noqa: F401  (registers the planner)
    from dsc.kernels.fused_moe import PLAN_BUCKETS, moe_config
    from dsc.kernels.launch import PLANNERS

    t = object()
    x, ids, w = NS(shape=(t, 2048), dtype=torch.bfloat16), NS(shape=(t, 8), dtype=torch.long), NS(shape=(t, 8))
    gu, dn = NS(shape=(128 * 1536, 2048), dtype=torch.int8), NS(shape=(128 * 2048, 768), dtype=torch.int8)
    gs, ds = NS(shape=(128 * 1536,)), NS(shape=(128 * 2048,))
    plan = PLANNERS["dsc.moe.default"](x, ids, w, gu, dn, 0, gs, ds, arch="sm_90")
    assert plan["name"] == "triton.fused_moe" and plan["launches"] == 4
    cfg = plan["config"]
    assert (cfg["H"], cfg["I"], cfg["E"], cfg["K"], cfg["int8"]) == (2048, 768, 128, 8, True)
    assert [f"T{b}" for b in PLAN_BUCKETS] == [key for key in cfg if key.startswith("T")]
    assert cfg["T1"] == moe_config(1, 2048, 768, 128, 8, "sm_90", 2, 1)
    assert cfg["T1"]["gate_up"]["BLOCK_M"] == 16 and cfg["T4096"]["gate_up"]["BLOCK_M"] == 128
    assert cfg["T1"]["gate_up"]["FAST_CVT"]
    json.dumps(plan)
    plain = PLANNERS["dsc.moe.default"](
        x, ids, w, NS(shape=gu.shape, dtype=torch.bfloat16), NS(shape=dn.shape, dtype=torch.bfloat16), 0, arch="sm_90"
    )
    assert not plain["config"]["int8"] and "FAST_CVT" not in plain["config"]["T1"]["gate_up"]


def test_configs_fit_and_split_decode():
    """Decode configs: BLOCK_M 16, a down GEMM split over I where the tiles leave SMs idle (Mixtral,
    one token: 2 experts' tiles); every default fits the shared-memory budget; and a smaller
    bucket never takes a larger BLOCK_M."""
    from dsc.kernels.fused_moe import PLAN_BUCKETS, SMEM, moe_config

    one = moe_config(1, 4096, 14336, 8, 2, "sm_90")
    assert one["gate_up"]["BLOCK_M"] == one["down"]["BLOCK_M"] == 16 and one["down"]["SPLIT_K"] > 1
    for shape in ((4096, 14336, 8, 2), (2048, 768, 128, 8), (1024, 1536, 8, 2)):
        prev = 0
        for b in PLAN_BUCKETS:
            for xb, wb in ((2, 2), (2, 1), (4, 4)):
                cfg = moe_config(b, *shape, "sm_90", xb, wb)
                for name, tiles in (("gate_up", 2), ("down", 1)):
                    c = cfg[name]
                    stage = c["BLOCK_K"] * (c["BLOCK_M"] * xb + tiles * c["BLOCK_N"] * wb)
                    assert c["num_stages"] >= 2 and stage * c["num_stages"] <= SMEM["sm_90"], (b, shape, xb, c)
            assert cfg["gate_up"]["BLOCK_M"] >= prev
            prev = cfg["gate_up"]["BLOCK_M"]


if __name__ == "__main__":
    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])
