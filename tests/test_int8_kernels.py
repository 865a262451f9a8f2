"""Int8 numerics (kernels/int8.py): quantize/dequantize properties, the plain-torch references
of dsc::linear_w8a16 / dsc::linear_w8a8, the custom-op registrations, and the Triton kernels
against the references in the Triton interpreter at small odd shapes (fp32 and fp16; the
interpreter's bf16 dot is wrong), plus an ahead-of-time build of every kernel for sm_90.

TRITON_INTERPRET=1 must be set before the first kernel is jitted, and other tests may have
imported triton already, so the kernel cases run in one subprocess: this file run as a script,
`python tests/test_int8_kernels.py interpret OUT.json` (or `aot OUT.json`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from kernel_child import child_fixtures, pdl_check, spill_bytes

from dsc.kernels import int8, launch
from dsc.kernels.activation import swiglu_reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


# -- quantize / dequantize properties -----------------------------------------------------------
@st.composite
def weights(draw):
    """[out, groups * group] fp32 with adversarial values: zeros, constants, huge ranges."""
    out, groups, group = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 19))
    scale = draw(st.sampled_from([1e-6, 1e-2, 1.0, 300.0]))
    a = draw(arrays(np.float32, (out, groups * group), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)))
    return torch.from_numpy(a) * scale, (group if groups > 1 else draw(st.sampled_from([None, group])))


@settings(max_examples=150, deadline=None)
@given(weights(), st.booleans())
def test_quantize_weight_properties(wg, symmetric):
    w, gs = wg
    p = int8.quantize_weight(w, gs, symmetric)
    q, s, z = p["qweight"], p["scale"], p["zero"]
    n, k = w.shape
    g = k // gs if gs else 1
    assert q.dtype == torch.int8 and q.shape == (n, k)
    assert s.dtype == torch.float32 and s.shape == (n, g) and z.dtype == torch.int8 and z.shape == (n, g)
    assert torch.isfinite(s).all() and (s > 0).all()
    wg3 = w.reshape(n, g, -1)
    if symmetric:
        amax = wg3.abs().amax(-1)
        assert (q >= -127).all() and (z == 0).all()
        # scale bounds: exactly max|w| / 127 (1 for an all-zero group)
        want = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).clamp(min=int8.SCALE_MIN)
        torch.testing.assert_close(s, want, rtol=1e-6, atol=0)
    else:
        lo, hi = wg3.amin(-1).clamp(max=0), wg3.amax(-1).clamp(min=0)
        span = hi - lo
        want = torch.where(span > 0, span / 255, torch.ones_like(span)).clamp(min=int8.SCALE_MIN)
        torch.testing.assert_close(s, want, rtol=1e-6, atol=0)
        # the zero point is the integer 0 maps to: 0.0 round-trips exactly
        assert int8.dequantize_weight(z, s, z).abs().max() == 0
    err = (int8.dequantize_weight(q, s, None if symmetric else z) - w).abs().reshape(n, g, -1)
    bound = s[..., None] / 2 * (1 + 1e-5) + 1e-30
    assert (err <= bound).all(), float((err / bound).max())


@settings(max_examples=80, deadline=None)
@given(
    arrays(
        np.float32,
        st.tuples(st.integers(1, 5), st.integers(1, 40)),
        elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
    ),
    st.booleans(),
)
def test_quantize_activation_properties(a, smooth):
    x = torch.from_numpy(a)
    inv = torch.linspace(0.25, 4.0, x.shape[1]) if smooth else None
    xq, xs = int8.quantize_activation(x, inv)
    v = x * inv if smooth else x
    assert xq.dtype == torch.int8 and (xq >= -127).all() and xs.shape == (x.shape[0], 1)
    assert (((xq.float() * xs) - v).abs() <= xs / 2 * (1 + 1e-5) + 1e-30).all()


def test_asymmetric_beats_symmetric_on_skewed_weights():
    g = torch.Generator().manual_seed(0)
    w = 1.0 + 0.3 * torch.randn(96, 200, generator=g)  # every weight positive: half the int8 range idle
    sq = {sym: int8.sqnr_db(w, int8.dequantize_weight(*_parts(w, None, sym))) for sym in (True, False)}
    assert sq[False] > sq[True] + 5, sq


def test_grouped_beats_per_channel_on_rows_with_outliers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    w[:, torch.randperm(256, generator=g)[:3]] *= 40  # a few outlier input channels per row
    per_ch = int8.sqnr_db(w, int8.dequantize_weight(*_parts(w, None, True)))
    grouped = int8.sqnr_db(w, int8.dequantize_weight(*_parts(w, 32, True)))
    assert grouped > per_ch + 3, (grouped, per_ch)


def _parts(w, gs, sym):
    p = int8.quantize_weight(w, gs, sym)
    return p["qweight"], p["scale"], None if sym else p["zero"]


def test_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="does not divide"):
        int8.quantize_weight(torch.randn(4, 30), 8)


# -- references and op registration --------------------------------------------------------------
OP_CASES = [  # (M, K, N, group_size, symmetric, bias, smooth)
    (3, 72, 47, None, True, False, False),
    (1, 72, 47, 24, False, True, False),
    (5, 96, 33, 32, True, True, True),
    (4, 64, 17, None, False, False, True),
    (2, 40, 9, 8, True, True, False),
]


def _op_args(m, k, n, gs, sym, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    p = int8.quantize_weight(w, gs, sym)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, p["qweight"], p["scale"], None if sym else p["zero"], b, gs or k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "case",
    OP_CASES,
    ids=lambda c: "M{}K{}N{}-g{}-{}{}{}".format(
        c[0], c[1], c[2], c[3], "sym" if c[4] else "asym", "-bias" if c[5] else "", "-smooth" if c[6] else ""
    ),
)
def test_references_are_the_dequantized_matmuls(case, dtype):
    m, k, n, gs, sym, bias, smooth = case
    x, q, s, z, b, group = _op_args(m, k, n, gs, sym, bias, dtype)
    w = int8.dequantize_weight(q, s, z)
    y = int8.linear_w8a16_reference(x, q, s, z, b, group)
    assert y.dtype == dtype and y.shape == (m, n)
    want = F.linear(x.float(), w.to(dtype).float(), None if b is None else b.float())
    torch.testing.assert_close(
        y.float(), want, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-2 if dtype != torch.float32 else 1e-4
    )
    inv = torch.linspace(0.5, 2.0, k) if smooth else None
    xq, xs = int8.quantize_activation(x, inv)
    want8 = F.linear((xq.float() * xs).double(), w.double(), None if b is None else b.double())
    y8 = int8.linear_w8a8_reference(x, q, s, z, b, group, inv)
    assert y8.dtype == dtype
    torch.testing.assert_close(
        y8.double(),
        want8.to(dtype).double(),
        rtol=1e-2 if dtype != torch.float32 else 1e-5,
        atol=1e-2 if dtype != torch.float32 else 1e-4,
    )


@pytest.mark.parametrize("mode", ["w8a16", "w8a8", "w8a16_swiglu"])
def test_custom_ops_pass_opcheck(mode):
    x, q, s, z, b, group = _op_args(3, 64, 40, 32, False, True, torch.float32)
    x = x.reshape(1, 3, 64)
    if mode == "w8a16":
        args = (x, q, s, z, b, group)
        op = torch.ops.dsc.linear_w8a16.default
    elif mode == "w8a16_swiglu":
        args = (x, q, s, z, group)
        op = torch.ops.dsc.linear_w8a16_swiglu.default
    else:
        args = (x, q, s, z, b, group, torch.linspace(0.5, 2.0, 64))
        op = torch.ops.dsc.linear_w8a8.default
    torch.library.opcheck(op, args)
    assert op(*args).shape == (1, 3, 20 if mode == "w8a16_swiglu" else 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_w8a16_swiglu_op_is_the_linear_and_swiglu_pair_on_cpu(dtype):
    """dsc.linear_w8a16_swiglu (what decode_linears makes of an --int8 gate_up and its swiglu)
    computes exactly the two ops' values off GPUs: the linear's output in the dtype, then swiglu."""
    x, q, s, z, _, group = _op_args(2, 64, 46, 16, False, False, dtype, seed=3)
    x = x.reshape(2, 1, 64)
    y = torch.ops.dsc.linear_w8a16(x, q, s, z, None, group)
    want = torch.ops.dsc.swiglu(y[..., :23], y[..., 23:])
    got = torch.ops.dsc.linear_w8a16_swiglu(x, q, s, z, group)
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="an even count"):
        int8.w8a16_gemv_swiglu(x[0], q[:45], s[:45], z[:45], group)


def test_w8a16_swiglu_config_halves_the_gemv_rows():
    """The fused kernel's tile is the W8A16 GEMV's: half as many outputs per program (each needs
    a gate and an up row), at least one."""
    for n2, k in ((28672, 4096), (7168, 4096), (14336, 4096), (16384, 2048)):
        gemv = int8.int8_config("w8a16_gemv", 1, n2, k, 0, "sm_90")
        got = int8.w8a16_swiglu_config(n2, k, 0, "sm_90")
        assert got == {**gemv, "BLOCK_N": max(1, gemv["BLOCK_N"] // 2)}, (n2, k)
    p = int8._plan_w8a16_swiglu(
        torch.empty(1, 4096, dtype=torch.bfloat16),
        torch.empty(28672, 4096, dtype=torch.int8),
        torch.empty(28672, 1),
        None,
        4096,
        arch="sm_90",
    )
    assert p["name"] == "triton.w8a16_gemv_swiglu" and p["launches"] == 1 and p["config"]["N"] == 28672


def test_int8_config_tuning_table_and_groups(monkeypatch):
    from dsc.kernels import launch

    table = {"sm_90": {"w8a16_gemv": {"M1_N4096_K4096": {"BLOCK_N": 4, "num_warps": 2}}}}
    monkeypatch.setattr(launch, "tuning_table", lambda: table)
    cfg = int8.int8_config("w8a16_gemv", 1, 4096, 4096, 0, "sm_90")
    assert cfg["BLOCK_N"] == 4 and cfg["num_warps"] == 2 and cfg["BLOCK_K"] == 1024  # table over default
    assert int8.int8_config("w8a16_gemv", 1, 4096, 4096, 0, "default")["BLOCK_N"] == 8
    # GEMM K-blocks shrink to divide the group size; buckets pick the tile family
    assert int8.int8_config("w8a8", 2048, 4096, 4096, 32, "sm_90")["BLOCK_K"] == 32
    assert int8.int8_config("w8a16_mma", 8, 4096, 4096, 0, "default")["BLOCK_M"] == 16
    assert int8.int8_config("w8a16_mma", 16, 4096, 4096, 0, "sm_90")["BLOCK_M"] == 16
    # 2-8 tokens on sm_90 without a row: the Gluon kernel, its form by 16-row tiles and K (regs_default)
    assert int8.int8_config("w8a16_mma", 8, 4096, 4096, 0, "sm_90") == int8.regs_default(4096, 4096)
    form = lambda n, k: tuple(int8.regs_default(n, k)[key] for key in ("WARPS_K", "BLOCK_K", "SPLIT_K", "EARLY"))  # noqa: E731
    assert [form(4096, k) for k in (14336, 8192, 1024)] == [(4, 128, 4, False), (4, 128, 4, False), (4, 256, 1, True)]
    assert [form(n, 4096) for n in (1536, 2048, 6144, 7168, 14336)] == [
        (4, 256, 4, True),
        (8, 256, 1, True),
        (8, 256, 1, True),
        (8, 128, 1, True),
        (4, 128, 1, True),
    ]
    assert form(2048, 8192) == (4, 128, 4, False) and form(28672, 8192) == (4, 128, 1, True)
    for n, k in ((1536, 4096), (2048, 2048), (6144, 4096), (4096, 1024), (7168, 14336), (100, 3000)):
        int8.regs_constexprs(int8.regs_default(n, k))  # a tile the kernel takes
    assert not int8.int8_config("w8a16_mma", 8, 4096, 4096, 0, "sm_90", table=False).get("REGS")
    assert int8.int8_config("w8a16_mma", 2048, 4096, 4096, 0, "sm_90")["BLOCK_M"] == 128
    assert [int8.int8_kernel("w8a16", m) for m in (1, 2)] == ["w8a16_gemv", "w8a16_mma"]
    # a row for the Triton mma kernel at 2-8 tokens keeps that kernel (not the Gluon default's keys)
    table["sm_90"]["w8a16_mma"] = {"M8_N4096_K14336": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 2, "SWAP_AB": True}}
    cfg = int8.int8_config("w8a16_mma", 8, 4096, 14336, 0, "sm_90")
    assert cfg == {**int8._DEFAULTS["w8a16_mma"][16], **table["sm_90"]["w8a16_mma"]["M8_N4096_K14336"]}


def test_every_int8_tuning_row_builds_its_kernel():
    """Each row of the checked-in table, as int8_config returns it, is a config its kernel
    takes: REGS rows (and the Gluon default) pass regs_constexprs, the others carry no Gluon key."""
    from dsc.kernels.launch import tuning_table

    seen = 0
    for arch, kernels in tuning_table().items():
        for kernel in ("w8a16_mma", "w8a16_gemv", "w8a8"):
            rows = kernels.get(kernel, {}) if isinstance(kernels, dict) else {}  # (skips comments)
            for shape_class, row in rows.items():
                m, n, k = (int(p[1:]) for p in shape_class.split("_")[:3])
                g = int(shape_class.split("_G")[1]) if "_G" in shape_class else 0
                cfg = int8.int8_config(kernel, m, n, k, g, arch)
                assert {key: cfg[key] for key in row if key != "BLOCK_K" or not g} == {
                    key: v for key, v in row.items() if key != "BLOCK_K" or not g
                }, (arch, kernel, shape_class)
                if cfg.get("REGS"):  # taken whole: no default's key (EARLY, say) leaks into a measured row
                    assert {key: v for key, v in cfg.items() if key != "BLOCK_K"} == {
                        key: v for key, v in row.items() if key != "BLOCK_K"
                    }, (arch, shape_class, cfg)
                    int8.regs_constexprs(cfg)
                else:
                    assert not {"REGS", "WARPS_K"} & set(cfg), (arch, kernel, shape_class, cfg)
                seen += 1
    assert seen >= 17


@pytest.mark.parametrize(
    "kernel, config, match",
    [
        ("w8a16_mma", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 0}, "SPLIT_K must be >= 1"),
        ("w8a16_gemm", {"BLOCK_M": 16}, "unknown w8a16 kernel"),
    ],
)
def test_w8a16_matmul_refuses_configs_it_cannot_run(kernel, config, match):
    x, q, s, z, b, group = _op_args(3, 64, 40, None, True, False, torch.float32)
    with pytest.raises(ValueError, match=match):
        int8.w8a16_matmul(x, q, s, z, b, group, kernel=kernel, config=config)


# -- Triton kernels in the interpreter (subprocess) ---------------------------------------------
KERNEL_CASES = {  # name: (kernel, M, K, N, group_size, symmetric, bias, smooth, config or None = default)
    "gemv-M1K72N47": (
        "w8a16_gemv",
        1,
        72,
        47,
        None,
        True,
        False,
        False,
        {"BLOCK_N": 8, "BLOCK_K": 32, "PREFETCH": False},
    ),
    "gemv-asym-bias-M1K72N47": (
        "w8a16_gemv",
        1,
        72,
        47,
        None,
        False,
        True,
        False,
        {"BLOCK_N": 4, "BLOCK_K": 64, "PREFETCH": True},
    ),
    "gemv-g24-asym-M1K72N47": (
        "w8a16_gemv",
        1,
        72,
        47,
        24,
        False,
        True,
        False,
        {"BLOCK_N": 8, "BLOCK_K": 32, "PREFETCH": False},
    ),
    "gemv-g32-aligned-M1K96N33": (
        "w8a16_gemv",
        1,
        96,
        33,
        32,
        True,
        False,
        False,
        {"BLOCK_N": 8, "BLOCK_K": 32, "PREFETCH": False},
    ),
    "gemv-default-M1K200N130": ("w8a16_gemv", 1, 200, 130, None, True, True, False, None),
    "gemv-xrow-asym-M1K72N47": (
        "w8a16_gemv",
        1,
        72,
        47,
        None,
        False,
        True,
        False,
        {"BLOCK_N": 4, "BLOCK_K": 32, "PREFETCH": False, "X_ROW": True},
    ),
    "gemv-xrow-g24-M1K72N47": (
        "w8a16_gemv",
        1,
        72,
        47,
        24,
        True,
        False,
        False,
        {"BLOCK_N": 8, "BLOCK_K": 32, "PREFETCH": True, "X_ROW": True},
    ),
    "mma-M3K72N47": ("w8a16_mma", 3, 72, 47, None, True, False, False, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}),
    "mma-asym-bias-M3K72N47": (
        "w8a16_mma",
        3,
        72,
        47,
        None,
        False,
        True,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16},
    ),
    "mma-g24-M3K72N47": (
        "w8a16_mma",
        3,
        72,
        47,
        24,
        False,
        False,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32},
    ),
    "mma-g32-aligned-M19K96N33": (
        "w8a16_mma",
        19,
        96,
        33,
        32,
        True,
        True,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32},
    ),
    "mma-default-M37K72N47": ("w8a16_mma", 37, 72, 47, None, True, False, False, None),
    # decode variants (issue 4): swapped operands, split-K (an empty last split at K96)
    "mma-swap-M3K72N47": (
        "w8a16_mma",
        3,
        72,
        47,
        None,
        True,
        False,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SWAP_AB": True},
    ),
    "mma-swap-asym-bias-M13K72N47": (
        "w8a16_mma",
        13,
        72,
        47,
        None,
        False,
        True,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SWAP_AB": True},
    ),
    "mma-swap-g24-asym-M8K72N47": (
        "w8a16_mma",
        8,
        72,
        47,
        24,
        False,
        True,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SWAP_AB": True},
    ),
    "mma-swap-g32-aligned-M2K96N33": (
        "w8a16_mma",
        2,
        96,
        33,
        32,
        True,
        True,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "SWAP_AB": True},
    ),
    "mma-splitk-bias-M3K200N47": (
        "w8a16_mma",
        3,
        200,
        47,
        None,
        True,
        True,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3},
    ),
    "mma-splitk-g24-asym-M13K72N47": (
        "w8a16_mma",
        13,
        72,
        47,
        24,
        False,
        True,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2},
    ),
    "mma-splitk-swap-g32-asym-M8K96N33": (
        "w8a16_mma",
        8,
        96,
        33,
        32,
        False,
        False,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 4, "SWAP_AB": True},
    ),
    "mma-splitk-M19K96N33": (
        "w8a16_mma",
        19,
        96,
        33,
        None,
        False,
        True,
        False,
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2},
    ),
    "w8a8-M3K72N47": ("w8a8", 3, 72, 47, None, True, False, False, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}),
    "w8a8-asym-smooth-bias-M3K72N47": (
        "w8a8",
        3,
        72,
        47,
        None,
        False,
        True,
        True,
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32},
    ),
    "w8a8-g32-asym-M5K96N33": ("w8a8", 5, 96, 33, 32, False, True, True, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}),
    "w8a8-default-M19K64N40": ("w8a8", 19, 64, 40, None, True, False, False, None),
    "w8a8-M0": ("w8a8", 0, 64, 40, None, True, False, False, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}),
}


def _kernel_case(name, dtype):
    kernel, m, k, n, gs, sym, bias, smooth, cfg = KERNEL_CASES[name]
    x, q, s, z, b, group = _op_args(m, k, n, gs, sym, bias, dtype, seed=len(name))
    if kernel == "w8a8":
        inv = torch.linspace(0.5, 2.0, k) if smooth else None
        got = int8.w8a8_matmul(x, q, s, z, b, group, inv, config=cfg)
        want = int8.linear_w8a8_reference(x, q, s, z, b, group, inv)
        xq, xs = int8.quantize_rows(x, inv)
        wq, ws = int8.quantize_activation(x, inv)
        if not (torch.equal(xq, wq) and torch.equal(xs, ws.reshape(-1))):
            return {"ok": False, "error": "quantize_rows differs from quantize_activation"}
    else:
        cfg = dict(cfg or int8.int8_config(kernel, m, n, k, 0 if group == k else group, "default"))
        cfg.setdefault("num_warps", 4)
        got = int8.w8a16_matmul(x, q, s, z, b, group, kernel=kernel, config=cfg)
        want = int8.linear_w8a16_reference(x.float(), q, s, z, None if b is None else b.float(), group)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    try:
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want.float(), **tol)
    except AssertionError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True}


SWIGLU_CASES = {  # (K, N outputs: the weight is [2N, K], group_size, symmetric, config or None: the default)
    "swiglu-K72N23": (72, 23, None, True, {"BLOCK_N": 4, "BLOCK_K": 32}),
    "swiglu-g24-asym-prefetch-K72N23": (72, 23, 24, False, {"BLOCK_N": 2, "BLOCK_K": 32, "PREFETCH": True}),
    "swiglu-g32-xrow-K96N16": (96, 16, 32, True, {"BLOCK_N": 4, "BLOCK_K": 32, "X_ROW": True}),
    "swiglu-one-row-asym-K40N9": (40, 9, None, False, {"BLOCK_N": 1, "BLOCK_K": 16}),
    "swiglu-default-K200N65": (200, 65, None, False, None),
}


def _swiglu_case(name, dtype):
    """`w8a16_gemv_swiglu` (one row) against the W8A16 GEMV's fp32 reference rounded to the dtype,
    then the swiglu reference on its halves: the unfused pair's values."""
    k, n, gs, sym, cfg = SWIGLU_CASES[name]
    x, q, s, z, _, group = _op_args(1, k, 2 * n, gs, sym, False, dtype, seed=len(name))
    cfg = dict(cfg or int8.w8a16_swiglu_config(2 * n, k, 0 if group == k else group, "default", x.element_size()))
    cfg.setdefault("num_warps", 2)
    got = int8.w8a16_gemv_swiglu(x, q, s, z, group, config=cfg)
    y = int8.linear_w8a16_reference(x.float(), q, s, z, None, group).to(dtype)
    want = swiglu_reference(y[:, :n], y[:, n:])
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)  # as the GEMV's
    try:
        assert got.dtype == dtype and got.shape == (1, n)
        torch.testing.assert_close(got.float(), want.float(), **tol)
    except AssertionError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True}


def run_interpreted(out: str) -> None:
    res = {f"{name}-{d}": _kernel_case(name, dt) for name in KERNEL_CASES for d, dt in DTYPES.items()}
    res.update({f"{name}-{d}": _swiglu_case(name, dt) for name in SWIGLU_CASES for d, dt in DTYPES.items()})
    # round half to even in the activation kernel, as torch.round
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.0, 3.49]])
    q, _ = int8.quantize_rows(x * (127 / 127.0))
    res["quantize_rows-round-half-even"] = {
        "ok": bool(torch.equal(q, int8.quantize_activation(x)[0])),
        "error": f"{q.tolist()}",
    }
    # split-K counters are reset by each tile's last split: a second call gives the same output
    x, q, s, z, b, group = _op_args(3, 72, 47, 24, False, True, torch.float32)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 4, "num_warps": 4}
    y1 = int8.w8a16_matmul(x, q, s, z, b, group, kernel="w8a16_mma", config=cfg)
    y2 = int8.w8a16_matmul(x, q, s, z, b, group, kernel="w8a16_mma", config=cfg)
    res["splitk-counters-reset"] = {
        "ok": bool(torch.equal(y1, y2) and not launch.COUNTERS[x.device].any()),
        "error": "second split-K launch differs or counters left non-zero",
    }
    Path(out).write_text(json.dumps(res, indent=1))


def run_aot(out: str) -> None:
    """Every kernel at its default sm_90 config, built for sm_90 without a GPU."""
    from dsc.kernels.launch import compile_for_arch

    ptr = lambda names, ty: {n: ty for n in names.split()}  # noqa: E731
    i32 = lambda names: {n: "i32" for n in names.split()}  # noqa: E731
    flags = dict(GROUP_K=0, HAS_ZERO=True, HAS_BIAS=True)
    cuda = torch.device("cuda")  # a device type only: FAST_CVT's inline PTX is built for CUDA
    cases = {}
    for name, m, gk in (("gemv", 1, 0), ("gemv-g128", 1, 128)):
        cfg = int8.int8_config("w8a16_gemv", m, 4096, 4096, gk, "sm_90")
        cases[name] = (
            int8._w8a16_gemv_kernel,
            {**ptr("X B Y", "*bf16"), **ptr("W Z", "*i8"), "S": "*fp32", **i32("N K G")},
            {**flags, "GROUP_K": gk, **cfg},
        )
    cases["gemv-xrow"] = (cases["gemv"][0], cases["gemv"][1], {**cases["gemv"][2], "X_ROW": True})
    for name, n2 in (("gemv-swiglu-tp1", 28672), ("gemv-swiglu-tp4", 7168)):  # Llama-8B's [gate; up]
        cases[name] = (
            int8._w8a16_gemv_swiglu_kernel,
            {**ptr("X Y", "*bf16"), **ptr("W Z", "*i8"), "S": "*fp32", **i32("N K G")},
            {"GROUP_K": 0, "HAS_ZERO": False, **int8.w8a16_swiglu_config(n2, 4096, 0, "sm_90")},
        )
    cases["gemv-prefetch-slowcvt"] = (
        cases["gemv"][0],
        cases["gemv"][1],
        {**cases["gemv"][2], "PREFETCH": True, "FAST_CVT": False},
    )
    mma_types = {
        **ptr("X B Y", "*bf16"),
        **ptr("W Z", "*i8"),
        "S": "*fp32",
        "P": "*fp32",
        "LOCK": "*i32",
        **i32("M N K G stride_xm stride_ym"),
    }
    for name, m, gk, variant in (
        ("mma-decode", 8, 0, {}),
        ("mma-prefill-g128", 2048, 128, {}),
        ("mma-decode-swap64", 8, 0, {"SWAP_AB": True, "BLOCK_N": 64, "SPLIT_K": 1, "num_warps": 4}),
        ("mma-decode-splitk4-g128", 8, 128, {"SPLIT_K": 4}),
        ("mma-decode-swap-splitk2-g100", 8, 100, {"SWAP_AB": True, "SPLIT_K": 2}),
    ):
        # M = 8 at 4096 -> 4096 is a REGS row (the Gluon kernel, below): the mma kernel's M = 8 row is 14336 -> 4096's
        row = int8.int8_config("w8a16_mma", m, 4096, 14336 if m == 8 else 4096, gk, "sm_90")
        if row.get("REGS"):  # 8 tokens without a row: the Gluon default; here the mma kernel's
            row = int8.int8_config("w8a16_mma", m, 4096, 4096, gk, "sm_90", table=False)
        cfg = {"SWAP_AB": False, "SPLIT_K": 1, **row, **variant}
        cases[name] = (int8._w8a16_mma_kernel, mma_types, {**flags, "GROUP_K": gk, "PRECISION": "tf32", **cfg})
    for name, m, gk in (("w8a8-prefill", 2048, 0), ("w8a8-decode-g128", 8, 128)):
        cfg = int8.int8_config("w8a8", m, 4096, 4096, gk, "sm_90")
        cases[name] = (
            int8._w8a8_kernel,
            {**ptr("B Y", "*bf16"), **ptr("XQ W Z", "*i8"), **ptr("XS S", "*fp32"), **i32("M N K G stride_ym")},
            {**flags, "GROUP_K": gk, **cfg},
        )
    cases["quantize_rows"] = (
        int8._quantize_rows_kernel,
        {"X": "*bf16", "INV": "*fp32", "Q": "*i8", "XS": "*fp32", **i32("K stride_xm")},
        dict(HAS_SMOOTH=True, BLOCK_K=2048),
    )
    # the W8A16 kernels also with PDL (kernels/launch.py), specialized as a launch is (aligned
    # pointers, sizes and strides multiples of 16: the mma's K loop is then software-pipelined);
    # what each may touch before the wait
    before_wait = {
        int8._w8a16_gemv_kernel: frozenset({"load w8", "load w_next"}),  # the first K-block(s)
        int8._w8a16_gemv_swiglu_kernel: frozenset({"load w8", "load w_next"}),
        int8._w8a16_mma_kernel: frozenset({"asm prefetch.global.L2"}),
    }  # weight lines into L2
    cases.update(
        {
            f"{name}-pdl": (fn, types, {**cfg, "PDL": True})
            for name, (fn, types, cfg) in cases.items()
            if fn in before_wait
        }
    )
    res = {}
    for name, (fn, types, cfg) in cases.items():
        const, opts = int8._split(cfg, cuda)
        aligned = [a for a, t in types.items() if t.startswith("*") or a in ("N", "K", "stride_xm", "stride_ym")]
        k = compile_for_arch(
            fn, types, const, num_warps=opts.get("num_warps", 4), aligned=tuple(aligned) if const.get("PDL") else ()
        )
        ptx = k.asm.get("ptx", "")
        res[name] = {
            "ok": bool(k.asm.get("cubin")),
            "ptx_has_mma": "mma" in ptx,
            "ptx_has_wgmma": "wgmma" in ptx,
            "fast_cvt": "prmt.b32" in ptx and "0f4B000080" in ptx,
            "wants_fast_cvt": bool(const.get("CVT")),
            "shared": k.metadata.shared,
            "pdl": pdl_check(k, const.get("PDL", False), before_wait.get(fn, frozenset())),
        }
    # the Gluon kernel (REGS configs; it cannot run in the interpreter, tests/gpu/test_gpu_int8.py
    # checks its numbers on a GPU): built as a launch specializes it, with PDL
    regs = dict(CVT=int8.I8X4_TO_F32, BLOCK_M=8, KW=16, HAS_BIAS=True, PDL=True)
    row = int8.int8_config("w8a16_mma", 8, 4096, 4096, 0, "sm_90")  # the table's REGS row
    assert row.get("REGS"), row
    row = int8.regs_constexprs(row)  # as the launch builds it
    for name, variant in (
        (
            "regs-m8",
            dict(GROUP_K=0, HAS_ZERO=False, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, PREFETCH=False, WARPS_N=1, WARPS_K=1),
        ),
        ("regs-table-row-m8", dict(GROUP_K=0, HAS_ZERO=False, **row)),
        (
            "regs-prefetch-splitk4-g128-asym",
            dict(GROUP_K=128, HAS_ZERO=True, BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, PREFETCH=True, WARPS_N=2, WARPS_K=2),
        ),
        (
            "regs-warpsk4",
            dict(GROUP_K=0, HAS_ZERO=False, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, PREFETCH=False, WARPS_N=1, WARPS_K=4),
        ),
        (
            "regs-early-splitk4-g128",
            dict(
                GROUP_K=128,
                HAS_ZERO=False,
                BLOCK_N=16,
                BLOCK_K=128,
                SPLIT_K=4,
                PREFETCH=False,
                EARLY=True,
                WARPS_N=1,
                WARPS_K=4,
            ),
        ),
        (
            "regs-early2-k256-warpsk8",
            dict(
                GROUP_K=0,
                HAS_ZERO=False,
                BLOCK_N=16,
                BLOCK_K=256,
                SPLIT_K=1,
                PREFETCH=False,
                EARLY=2,
                WARPS_N=1,
                WARPS_K=8,
            ),
        ),
        (
            "regs-early2-splitk4-g128-asym",
            dict(
                GROUP_K=128,
                HAS_ZERO=True,
                BLOCK_N=16,
                BLOCK_K=128,
                SPLIT_K=4,
                PREFETCH=False,
                EARLY=2,
                WARPS_N=1,
                WARPS_K=4,
            ),
        ),
        ("regs-default-n6144", dict(GROUP_K=0, HAS_ZERO=False, **int8.regs_constexprs(int8.regs_default(6144, 4096)))),
    ):
        aligned = tuple(
            a for a, t in mma_types.items() if t.startswith("*") or a in ("N", "K", "stride_xm", "stride_ym")
        )
        k = compile_for_arch(
            int8._w8a16_regs_kernel,
            mma_types,
            {**regs, **variant},
            num_warps=variant["WARPS_N"] * variant["WARPS_K"],
            aligned=aligned,
            gluon=True,
        )
        ptx = k.asm.get("ptx", "")
        res[name] = {
            "ok": bool(k.asm.get("cubin")),
            "ptx_has_mma": "mma" in ptx,
            "ptx_has_wgmma": "wgmma" in ptx,
            "fast_cvt": "prmt.b32" in ptx and "0f4B000080" in ptx,
            "wants_fast_cvt": True,
            "mma_sync": ptx.count("mma.sync.aligned.m16n8k16"),
            "weight_loads_16B": len(re.findall(r"ld\.global\.L1::evict_first[.\w:]*\.v4\.b32", ptx)),
            "shared_ops": len(re.findall(r"\b(?:ld|st)\.shared", ptx)),
            "shared": k.metadata.shared,
            "spill_bytes": spill_bytes(k),
            "split_k": variant["SPLIT_K"],
            "warps_k": variant["WARPS_K"],
            "pdl": pdl_check(k, True, frozenset(("load w8_first", "load w8_second")[: int(variant.get("EARLY", 0))])),
        }
    # the Triton mma kernel's shared memory with fp32 activations (fp32 models' int8 path), at
    # the config w8a16_matmul picks for every shape the sm_90 table has rows for and for the
    # defaults of the larger M buckets: the 16-bit rows' K-blocks took 248 KiB at Llama-8B's
    # M64 [4096, 4096], over an H200's 227 (its `OutOfResources` at CUDA-graph capture)
    fp32_types = {**mma_types, **ptr("X B Y", "*fp32")}
    aligned = tuple(a for a, t in fp32_types.items() if t.startswith("*") or a in ("N", "K", "stride_xm", "stride_ym"))
    shapes = {tuple(int(p[1:]) for p in key.split("_")[:3]) for key in launch.tuning_table()["sm_90"]["w8a16_mma"]}
    shapes |= {(m, 4096, 4096) for m in (16, 64, 256)}
    seen = set()
    for m, n, k_ in sorted(shapes):
        cfg = int8.int8_config("w8a16_mma", m, n, k_, 0, "sm_90", x_bytes=4)
        if cfg.get("REGS"):  # the Gluon kernel takes 16-bit x only: w8a16_matmul's fallback
            cfg = int8.int8_config("w8a16_mma", m, n, k_, 0, "sm_90", table=False, x_bytes=4)
        const, opts = int8._split(
            {**flags, "HAS_ZERO": False, "PRECISION": "ieee", "SWAP_AB": False, "SPLIT_K": 1, "FAST_CVT": False, **cfg},
            cuda,
        )
        key = json.dumps([const, opts], sort_keys=True)  # one build per distinct config
        if key in seen:
            continue
        seen.add(key)
        k = compile_for_arch(
            int8._w8a16_mma_kernel,
            fp32_types,
            const,
            num_warps=opts.get("num_warps", 4),
            num_stages=opts.get("num_stages"),
            aligned=aligned,
        )
        res[f"fp32-smem-M{m}_N{n}_K{k_}"] = {
            "ok": bool(k.asm.get("cubin")),
            "shared": k.metadata.shared,
            "config": {**const, **opts},
        }
    Path(out).write_text(json.dumps(res, indent=1))


interpreted, compiled = child_fixtures(__file__, "int8")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_reference_in_interpreter(case, dtype, interpreted):
    r = interpreted[f"{case}-{dtype}"]
    assert r["ok"], r.get("error")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(SWIGLU_CASES))
def test_gemv_swiglu_kernel_is_the_gemv_and_swiglu_pair_in_interpreter(case, dtype, interpreted):
    """The W8A16 gate_up GEMV + SwiGLU at one row (gate and up rows interleaved in each
    program's tile: per channel and grouped scales, zero points, PREFETCH, X_ROW, one output per
    program, the default config) against the pair's values."""
    r = interpreted[f"{case}-{dtype}"]
    assert r["ok"], r.get("error")


def test_activation_kernel_rounds_half_to_even(interpreted):
    r = interpreted["quantize_rows-round-half-even"]
    assert r["ok"], r["error"]


def test_split_k_counters_are_reset(interpreted):
    r = interpreted["splitk-counters-reset"]
    assert r["ok"], r["error"]


def _builds(compiled: dict) -> dict:
    """The kernel builds of the aot child, without its shared-memory probes (`fp32-smem-*`)."""
    return {k: v for k, v in compiled.items() if not k.startswith("fp32-smem-")}


def test_kernels_compile_for_sm90(compiled):
    compiled = _builds(compiled)
    bad = {k: v for k, v in compiled.items() if not v["ok"]}
    assert compiled and not bad, bad
    assert all(v["ptx_has_mma"] for k, v in compiled.items() if k.startswith(("mma", "w8a8"))), compiled
    assert all(v["fast_cvt"] == v["wants_fast_cvt"] for v in compiled.values()), compiled
    assert compiled["gemv"]["fast_cvt"] and compiled["mma-decode"]["fast_cvt"]  # the sm_90 defaults
    assert compiled["mma-decode-swap64"]["ptx_has_wgmma"]  # 64-row weight tiles as wgmma's A operand


def test_fp32_activation_configs_fit_sm90_shared_memory(compiled):
    """fp32 x through the Triton mma kernel (what an fp32 model's --int8 runs at 2-256 tokens):
    every config the runtime picks on sm_90 fits the 227 KiB a block may opt into on an
    H100/H200 (cudaDevAttrMaxSharedMemoryPerBlockOptin: 232448 bytes)."""
    smem = {k: v for k, v in compiled.items() if k.startswith("fp32-smem-")}
    assert len(smem) >= 4, list(compiled)
    for name, r in smem.items():
        assert r["ok"] and 0 < r["shared"] <= 232448, (name, r)


def test_fp32_activations_halve_the_mma_k_block():
    for m, n, k in ((64, 4096, 4096), (64, 4096, 14336), (256, 4096, 4096)):
        bf16 = int8.int8_config("w8a16_mma", m, n, k, 0, "sm_90")
        fp32 = int8.int8_config("w8a16_mma", m, n, k, 0, "sm_90", x_bytes=4)
        assert fp32 == {**bf16, "BLOCK_K": bf16["BLOCK_K"] // 2}, (m, n, k)
    # a group's size still divides the K-block; the Gluon rows (16-bit x only) are left alone
    assert int8.int8_config("w8a16_mma", 64, 4096, 4096, 128, "sm_90", x_bytes=4)["BLOCK_K"] == 64
    regs = int8.int8_config("w8a16_mma", 8, 4096, 4096, 0, "sm_90", x_bytes=4)
    assert regs.get("REGS") and regs == int8.int8_config("w8a16_mma", 8, 4096, 4096, 0, "sm_90")


def test_regs_kernel_builds_for_sm90_without_shared_memory(compiled):
    """The Gluon kernel's point: 16-byte weight loads straight into mma.sync's operand registers,
    no shared memory in the K loop (only the WARPS_K parts' final sum and split-K's last-split
    election use some), no spills, and nothing but EARLY's first weight block (read-only)
    touched before the PDL wait (EARLY 2: the first two)."""
    regs = {k: v for k, v in compiled.items() if k.startswith("regs")}
    assert len(regs) == 8, list(compiled)
    for name, r in regs.items():
        assert r["ok"] and r["mma_sync"] > 0 and r["weight_loads_16B"] > 0 and r["spill_bytes"] == 0, (name, r)
        assert r["pdl"] == "ok", (name, r)
        if r["split_k"] == 1 and r["warps_k"] == 1:
            assert r["shared"] == 0 and r["shared_ops"] == 0, (name, r)
        else:  # at most the parts' [WARPS_K, BLOCK_N <= 32, BLOCK_M 8] fp32 sums, and a word
            assert 0 < r["shared"] <= 16 + r["warps_k"] * 32 * 8 * 4, (name, r)


def test_regs_configs_fall_back_off_gpu_and_refuse_bad_tiles(monkeypatch):
    """A tuning row with REGS runs the Triton mma kernel where Gluon cannot (CPU, fp32 x); a
    pinned REGS config there, or a tile the MMA layout cannot hold, is refused."""
    from dsc.kernels import launch

    row = {"REGS": True, "BLOCK_M": 8, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 1}
    table = {"default": {"w8a16_mma": {"M8_N40_K64": row}}}
    monkeypatch.setattr(launch, "tuning_table", lambda: table)
    assert int8.int8_config("w8a16_mma", 8, 40, 64, 0, "default")["REGS"]
    x, q, s, z, b, group = _op_args(8, 64, 40, None, True, False, torch.float32)
    launched = []  # (kernel, grid, constexprs) of each launch, instead of running it (no interpreter here)

    class Launcher:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((self.fn.__name__, grid, kw))

    monkeypatch.setattr(int8, "jit", Launcher)
    int8.w8a16_matmul(x, q, s, z, b, group)  # the built-in mma default instead of the row
    d = int8._DEFAULTS["w8a16_mma"][16]
    assert [(n, g) for n, g, _ in launched] == [("_w8a16_mma_kernel", (-(-40 // d["BLOCK_N"]), 1, 1))]
    cfg = launched[0][2]
    # x is fp32: the default's K-block halved (int8_config's x_bytes)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]) == (
        d["BLOCK_M"],
        d["BLOCK_N"],
        d["BLOCK_K"] // 2,
        1,
    )
    assert "REGS" not in cfg
    with pytest.raises(ValueError, match="REGS"):
        int8.w8a16_matmul(x, q, s, z, b, group, kernel="w8a16_mma", config=row)
    assert int8._regs_usable(x.to(torch.bfloat16), 0, row) is False  # CPU
    bad = {**row, "BLOCK_N": 16, "num_warps": 2}  # 16 rows cannot feed 2 warps' MMAs
    with pytest.raises(ValueError, match="BLOCK_N of 16 \\* num_warps"):
        int8._w8a16_regs(x, q, s, z, b, 0, 1, bad, torch.empty(8, 40))


def test_w8a16_pdl_variants_read_only_weights_before_the_wait(compiled):
    compiled = _builds(compiled)
    pdl = [name for name in compiled if name.endswith("-pdl")]
    assert len(pdl) == 11, list(compiled)  # every gemv (SwiGLU included) and mma case
    bad = {k: v["pdl"] for k, v in compiled.items() if v["pdl"] != "ok"}
    assert not bad, bad


def test_fast_int8_conversion_arithmetic():
    """I8X4_TO_F32, the PTX the CUDA kernels use for int8 -> fp32, emulated bit for bit over all
    256 bytes in every byte position (PTX prmt: bytes 0-3 from a, 4-7 from b; selector nibbles)."""
    import re

    asm = int8.I8X4_TO_F32
    sels = [int(s, 16) for s in re.findall(r"prmt\.b32 \$\d, t, 0x4B000000, 0x([0-9A-F]{4})", asm)]
    flip = int(re.search(r"xor\.b32 t, \$4, 0x([0-9a-fA-F]{8})", asm).group(1), 16)
    bias = np.array([int(re.search(r"0f([0-9A-F]{8})", asm).group(1), 16)], np.uint32).view(np.float32)[0]

    def prmt(a: int, b: int, c: int) -> int:
        src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
        return sum(src[(c >> 4 * i) & 0x7] << 8 * i for i in range(4))

    v = np.arange(-128, 128, dtype=np.int8)
    for pos, sel in enumerate(sels):
        words = (v.astype(np.uint8).astype(np.uint32) << (8 * pos)) | 0x5A000000 * (pos != 3)  # other bytes: junk
        got = [np.array([prmt(int(w) ^ flip, 0x4B000000, sel)], np.uint32).view(np.float32)[0] - bias for w in words]
        assert np.array_equal(np.array(got, np.float32), v.astype(np.float32)), pos


def test_bench_int8_smoke_runs_every_default(tmp_path):
    """scripts/bench_int8.py --smoke in the interpreter: the benchmark's code path at tiny shapes
    (1 and 8 tokens, W8A8), each default config run and checked against the reference, the JSON
    written (on CPU the launch takes the built-in defaults: the sm_90 Gluon rows cannot run)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_int8.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "failed" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "bench_int8.json").read_text())
    assert not res["correctness_errors"]
    assert sorted({(r["op"], r["M"]) for r in res["results"]}) == [("w8a16", 1), ("w8a16", 8), ("w8a8", 64)]
    assert all(r["default"]["ms"] > 0 and r["default"]["sqnr_vs_ref_db"] > 30 for r in res["results"])


if __name__ == "__main__":
    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])
