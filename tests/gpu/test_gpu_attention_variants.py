"""GPU check section `attention_variants`: logit soft-capping and ALiBi in every Triton attention
kernel (kernels/attention.py prefill, decode and rotary decode; kernels/paged_attention.py decode
and varlen) against the plain-torch reference at real shapes, bf16 and fp32.

    pytest tests/gpu/test_gpu_attention_variants.py          # on a CUDA machine

Heads: gemma2-9B's (16 query heads, 8 kv heads, head_dim 256) with its softcap 50 and with a cap
of 2 that bends every score; bloom-7B's (32 heads, one per kv head, head_dim 128) with bloom's
slopes 2^(-8 h / 32); Llama-8B's (32 / 8, head_dim 128) with both. Static cases poison the
output and every cache slot the call must not read (NaN) and check
  - out: relative error ||out - ref|| / ||ref|| against the fp32 reference within
    max(floor, 2 x the error of the same reference on inputs rounded to the dtype), floor 1e-2
    in bf16 and 1e-4 in fp32, and no NaN;
  - the cache: the new tokens' k/v written exactly where the reference writes them, nothing else.
Paged steps run through tests/gpu/test_gpu_paged_attention.py's `check` (the same checks on the
pools). The 16-bit head_dim-128 prefills are those the sm_90 table sends to the warp-specialized
kernel without a variant: these must take the generic kernel. Also: `torch.ops.dsc.attention`
and `dsc.paged_attention` with the variant dispatch to the kernels (bit-equal to the wrappers).
Writes $OUT/gpu_attention_variants.json when OUT is set.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import pytest
import torch
from gpu_util import ROOT, out_problems, write_summary

sys.path.insert(0, str(ROOT / "tests"))  # tests/paged_steps.py: the steps the CPU tests build too
from paged_steps import Case, decode_case  # noqa: E402

from dsc.kernels import attention as A  # noqa: E402

DEVICE = "cuda"


@dataclass(frozen=True)
class Heads:
    H: int
    Hkv: int
    D: int
    softcap: float = 0.0
    alibi: bool = False


MODELS = {
    "gemma2-cap50": Heads(16, 8, 256, softcap=50.0),
    "gemma2-cap2": Heads(16, 8, 256, softcap=2.0),
    "bloom-alibi": Heads(32, 32, 128, alibi=True),
    "llama-both": Heads(32, 8, 128, softcap=5.0, alibi=True),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FLOOR = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def slopes(heads: Heads):
    """bloom's ALiBi slopes for a power-of-two head count: 2^(-8 h / H), h = 1..H."""
    if not heads.alibi:
        return None
    return 2.0 ** (-8.0 * torch.arange(1, heads.H + 1, device=DEVICE, dtype=torch.float32) / heads.H)


def make(heads: Heads, dtype, B, S, Smax, cache_pos, window=0, seed=0):
    """Inputs with NaN in every cache slot the call must not read or write."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=DEVICE, dtype=dtype)  # noqa: E731
    q, k, v = rand(B, heads.H, S, heads.D), rand(B, heads.Hkv, S, heads.D), rand(B, heads.Hkv, S, heads.D)
    k_cache, v_cache = rand(B + 1, heads.Hkv, Smax, heads.D), rand(B + 1, heads.Hkv, Smax, heads.D)
    pos = torch.tensor(cache_pos, device=DEVICE, dtype=torch.int64)
    unread = torch.ones(B + 1, Smax, dtype=torch.bool, device=DEVICE)
    unread[:B] = torch.arange(Smax, device=DEVICE)[None, :] >= (pos[:, None] + S)
    if window:
        unread[:B] |= torch.arange(Smax, device=DEVICE)[None, :] <= pos[:, None] - window
    for c in (k_cache, v_cache):
        c.masked_fill_(unread[:, None, :, None], float("nan"))
    return q, k, v, k_cache, v_cache, pos


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def check_static(name, heads: Heads, dtype, B, S, Smax, cache_pos, window=0, rotary=False, via_op=False):
    """One static call (prefill for S > 1, decode for S == 1; rotary: rotary_attention's decode
    with rot_pos tables) against the references; a summary row."""
    t0 = time.time()
    q, k, v, k_cache, v_cache, pos = make(heads, dtype, B, S, Smax, cache_pos, window, seed=len(name))
    variant = dict(softcap=heads.softcap, alibi_slopes=slopes(heads))
    scale = heads.D**-0.5
    rot = {}
    q_in, k_in = q, k
    if rotary:
        g = torch.Generator(device=DEVICE).manual_seed(1)
        tables = [torch.rand(Smax + 8, heads.D, generator=g, device=DEVICE, dtype=dtype) * 2 - 1 for _ in range(2)]
        rot_pos = pos[:, None] + 3  # rows other than the positions (the op allows any)
        rot = dict(rotary=tables, rot_pos=rot_pos)
        q_in, k_in = A.rotary_reference(q, k, *A.rotary_rows(*tables, rot_pos))
    clean = [t.nan_to_num() for t in (k_cache, v_cache)]
    ref32 = A.attention_reference(
        q_in.float(), k_in.float(), v.float(), *(c.float() for c in clean), pos, scale, window, **variant
    )
    ref_low = A.attention_reference(q_in, k_in, v, *(c.clone() for c in clean), pos, scale, window, **variant)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    A.write_kv_cache_reference(k_in, v, want_k, want_v, pos)
    out = torch.full((B, S, heads.H, heads.D), float("nan"), device=DEVICE, dtype=dtype)
    if via_op:
        out = torch.ops.dsc.attention(
            q, k, v, k_cache, v_cache, pos, scale, window, heads.softcap, variant["alibi_slopes"]
        )
    elif S == 1:
        A.decode_attention(q, k, v, k_cache, v_cache, pos, scale, window, out=out, **variant, **rot)
    else:
        A.prefill_attention(q, k, v, k_cache, v_cache, pos, scale, window, out=out, **variant)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    err, err_low = rel_err(out, ref32), rel_err(ref_low, ref32)
    limit = max(FLOOR[dtype], 2 * err_low)
    problems = out_problems(out, err, limit, (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)))
    print(
        f"{'ok  ' if not problems else 'FAIL'} {name:48s} rel_err {err:.2e} (reference in the dtype: {err_low:.2e})"
        f"  {'; '.join(problems)}",
        flush=True,
    )
    return dict(
        case=name,
        rel_err=err,
        low_precision_reference_rel_err=err_low,
        ok=not problems,
        problems=problems,
        seconds=round(time.time() - t0, 2),
    )


def static_cases(model: str) -> dict:
    """name -> check_static keyword arguments."""
    cases = {
        "prefill-fresh": dict(B=2, S=700, Smax=2048, cache_pos=[0, 0]),
        "prefill-chunked": dict(B=2, S=300, Smax=2048, cache_pos=[1000, 37]),
        "prefill-window": dict(B=2, S=900, Smax=2048, cache_pos=[0, 500], window=256),
        "decode": dict(B=8, S=1, Smax=4096, cache_pos=[4095, 0, 1, 2051, 130, 777, 3000, 64]),
        "decode-window": dict(B=4, S=1, Smax=4096, cache_pos=[4095, 0, 300, 2051], window=256),
        "decode-batch1-long": dict(B=1, S=1, Smax=8192, cache_pos=[8000]),
    }
    if MODELS[model].D == 128:  # the rotary decode kernel at Llama-like heads (rot_pos tables)
        cases["decode-rotary-table"] = dict(B=4, S=1, Smax=4096, cache_pos=[4095, 0, 300, 2051], rotary=True)
    return cases


def paged_cases(heads: Heads) -> dict:
    kw = dict(Hkv=heads.Hkv, G=heads.H // heads.Hkv, D=heads.D, softcap=heads.softcap, alibi=heads.alibi)
    return {
        "paged-decode": decode_case(((4000, 1), (0, 1), (0, 0), (517, 1), (2047, 1)), BS=16, **kw),
        "paged-decode-window": decode_case(((4000, 1), (33, 1), (1200, 1)), BS=16, window=256, **kw),
        # a mixed step: a fresh chunk, chunks on cached prefixes, decode tokens, padding
        "paged-mixed": Case(seqs=((0, 700), (1000, 300), (40, 1), (3000, 1), (0, 0)), BS=16, pad_rows=5, **kw),
        "paged-mixed-window": Case(seqs=((1500, 400), (0, 600), (900, 1)), BS=32, window=256, **kw),
    }


ROWS: list = []


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    write_summary("gpu_attention_variants", ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model", list(MODELS))
def test_static_kernels(model, dtype):
    rows = [
        check_static(f"{model}/{dtype}/{name}", MODELS[model], DTYPES[dtype], **kw)
        for name, kw in static_cases(model).items()
    ]
    ROWS.extend(rows)
    assert all(r["ok"] for r in rows), [r["case"] for r in rows if not r["ok"]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model", list(MODELS))
def test_paged_kernels(model, dtype):
    from test_gpu_paged_attention import check

    rows = [check(f"{model}/{dtype}/{name}", case, DTYPES[dtype]) for name, case in paged_cases(MODELS[model]).items()]
    ROWS.extend(rows)
    assert all(r["ok"] for r in rows), [r["case"] for r in rows if not r["ok"]]


@pytest.mark.gpu
def test_ops_dispatch_to_the_kernels():
    """dsc.attention with the variant on CUDA: the kernels (their output within the checks);
    dsc.paged_attention: bit-equal to its wrapper."""
    from paged_steps import args_of, build

    from dsc.kernels import paged_attention as P

    heads = MODELS["llama-both"]
    rows = [
        check_static(f"op/{name}", heads, torch.bfloat16, via_op=True, **static_cases("llama-both")[name])
        for name in ("prefill-chunked", "decode")
    ]
    step = build(paged_cases(heads)["paged-mixed"], torch.bfloat16, device=DEVICE)
    mine = {**step, "k_pool": step["k_pool"].clone(), "v_pool": step["v_pool"].clone()}
    via_op = torch.ops.dsc.paged_attention(*args_of(step))
    direct = P.paged_attention_triton(*args_of(mine))
    ROWS.extend(rows)
    assert all(r["ok"] for r in rows)
    assert torch.equal(via_op, direct) and torch.equal(step["k_pool"].nan_to_num(7.0), mine["k_pool"].nan_to_num(7.0))
