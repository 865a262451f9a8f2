"""The Triton attention kernels (kernels/attention.py) against `attention_reference`.

The kernels run in the Triton interpreter on CPU. TRITON_INTERPRET=1 must be set before triton
is first imported, and other test files may import triton, so every case runs in one child
process (this file run as a script) whose JSON report the parametrized tests read. A second
child compiles the kernels for sm_90 (no GPU needed), which the interpreter cannot check.
The interpreter's bf16 tl.dot does not round as the GPU's does: cases run in fp16 and fp32.
Every unwindowed prefill case (and one windowed) also runs with the prefill variant's keys on
(TMA descriptors in fp16, deferred p @ v: kernels/attention.py PREFILL_VARIANTS; VARIANT_RUNS);
the interpreter runs host TMA descriptors (zero fill past a tensor's end included) but not
Hopper's asynchrony, so the sm_90 builds are checked too: each build in bf16, the default
prefill and decode, the warp-specialized prefill and the rotating kernels in fp16 too (FP16_BUILDS).
The rotary decode cases run `dsc::rotary_attention`'s kernel (decode_attention with rotary=(cos, sin))
against dsc.rotary's reference then attention's, and against the unfused kernels (rotary, then
plain decode attention): the same bits, output and cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch
from kernel_child import pdl_check
from paged_steps import alibi_slopes_for


@dataclass(frozen=True)
class Case:
    kind: str  # "prefill" | "decode": which wrapper runs
    B: int
    H: int
    Hkv: int
    S: int
    D: int
    Smax: int
    cache_pos: tuple
    Bmax: int = 0  # cache rows (0: B + 1, so one row must stay untouched)
    config: dict | None = field(default=None, hash=False)  # None: attention_config's table
    num_splits: int | None = None  # decode only; None: decode_num_splits's heuristic
    window: int = 0  # sliding window (0: none)
    fused_qkv: bool = False  # q, k, v as the runtime passes them: transposed views of one [B, S, (H + 2 Hkv) D]
    rotary: bool = False  # dsc.rotary_attention: q and k are rotated in the kernel (decode only)
    rot_table: bool = False  # ... with rot_pos: cos / sin are tables [P, D] whose rows the kernel reads
    softcap: float = 0.0  # logit soft-capping (0: none)
    alibi: bool = False  # ALiBi with paged_steps.alibi_slopes_for(H)


SMALL_PREFILL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
SMALL_DECODE = dict(BLOCK_N=16, num_warps=4, num_stages=1, MIN_SPLIT=16)
SM90_PREFILL = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)  # PREFILL_CONFIGS[("sm_90", 128)]

CASES = {
    # prefill: a right-padded batch (all cache_pos 0), as Engine.prefill sends it
    "prefill-gqa3-fresh": Case("prefill", 3, 6, 2, 5, 16, 37, (0, 0, 0), config=SMALL_PREFILL),
    # chunked prompts: a cached prefix (phase 1) with a partial last tile
    "prefill-gqa3-chunked": Case("prefill", 3, 6, 2, 5, 16, 37, (0, 7, 19), config=SMALL_PREFILL),
    # several row tiles, full and partial key tiles in both phases, tiles not aligned to G
    "prefill-gqa3-tiles": Case("prefill", 3, 6, 2, 23, 32, 61, (0, 9, 33), config=SMALL_PREFILL),
    # tokens past the end of the cache: not written, and they attend to the whole cache
    "prefill-overflow": Case("prefill", 3, 6, 2, 7, 16, 37, (0, 33, 36), config=SMALL_PREFILL),
    "prefill-mha": Case("prefill", 2, 3, 3, 9, 32, 37, (0, 21), config=SMALL_PREFILL),
    # G = 1 with row tiles longer than key tiles (GPT-2 at the sm_90 table: 128 x 64): the cache
    # write takes its own loop (the masked loop can exceed 2 tiles)
    "prefill-mha-long-tiles": Case(
        "prefill", 2, 3, 3, 45, 16, 80, (0, 21), config=dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    ),
    "prefill-mqa": Case("prefill", 2, 4, 1, 6, 16, 37, (3, 0), config=SMALL_PREFILL),
    "prefill-d48": Case("prefill", 2, 4, 2, 7, 48, 37, (0, 5), config=SMALL_PREFILL),  # padded head_dim
    # padded head_dim with full (unmasked) key tiles in both phases
    "prefill-d48-tiles": Case("prefill", 2, 4, 2, 37, 48, 61, (0, 19), config=SMALL_PREFILL),
    "prefill-s1": Case("prefill", 3, 6, 2, 1, 16, 37, (0, 17, 36), config=SMALL_PREFILL),
    # several full (unmasked) key tiles in both phases: the variant's deferred p @ v loops run
    # more than one iteration (prefix 50 = 3 full tiles + a partial one; up to 4 new full tiles)
    "prefill-gqa2-long-loops": Case("prefill", 2, 4, 2, 75, 16, 160, (0, 50), config=SMALL_PREFILL),
    "prefill-table-config": Case("prefill", 2, 6, 2, 13, 32, 37, (0, 4)),
    # q/k/v strided views of the fused projection's output (TMA descriptors take their strides)
    "prefill-fused-qkv": Case("prefill", 2, 4, 2, 37, 16, 61, (0, 19), config=SMALL_PREFILL, fused_qkv=True),
    # decode: one split (the kernel writes out itself, no reduce launch)
    "decode-one-split": Case("decode", 3, 6, 2, 1, 16, 37, (0, 20, 36)),
    # split over the cache: pos 0 (no cached key), mid (2 of 3 splits used), last slot
    "decode-splits": Case("decode", 3, 6, 2, 1, 16, 37, (0, 20, 36), config=SMALL_DECODE, num_splits=3),
    # MIN_SPLIT (the floor here) not a multiple of BLOCK_N: splits stay whole tiles
    "decode-split-unaligned": Case(
        "decode", 3, 6, 2, 1, 32, 61, (5, 40, 60), num_splits=3, config=dict(SMALL_DECODE, MIN_SPLIT=24)
    ),
    # SPLIT_FLOOR below MIN_SPLIT (the sm_90 row's 128 / 256): a short context spreads over
    # splits of 16 keys (3 of 4 at position 40), not MIN_SPLIT's 32 (one split of 48 there)
    "decode-split-floor": Case(
        "decode",
        3,
        6,
        2,
        1,
        16,
        64,
        (10, 20, 40),
        num_splits=4,
        config=dict(SMALL_DECODE, MIN_SPLIT=32, SPLIT_FLOOR=16),
    ),
    "decode-overflow": Case("decode", 3, 6, 2, 1, 16, 37, (37, 50, 15), config=SMALL_DECODE, num_splits=3),
    "decode-mha": Case("decode", 2, 3, 3, 1, 32, 37, (11, 30), config=SMALL_DECODE, num_splits=2),
    "decode-mqa": Case("decode", 2, 8, 1, 1, 16, 37, (2, 35), config=SMALL_DECODE, num_splits=3),
    "decode-d48": Case("decode", 2, 4, 2, 1, 48, 37, (9, 36), config=SMALL_DECODE, num_splits=3),
    # head_dim below the tiles' 16 columns (tiny models: 72 hidden over 6 heads), padded like 48
    "prefill-d12": Case("prefill", 2, 6, 2, 9, 12, 37, (0, 5), config=SMALL_PREFILL),
    "decode-d12": Case("decode", 2, 6, 2, 1, 12, 37, (9, 36), config=SMALL_DECODE, num_splits=2),
    "decode-rotary-d12": Case("decode", 2, 6, 2, 1, 12, 37, (9, 36), config=SMALL_DECODE, num_splits=2, rotary=True),
    # more splits than a sequence has tiles: most exit at once, the reduce skips them
    "decode-many-splits": Case("decode", 2, 4, 2, 1, 16, 70, (36, 69), config=SMALL_DECODE, num_splits=7),
    # sliding window: keys below each query's window are skipped (their slots are poisoned);
    # windows shorter and longer than a tile, cached prefixes inside and beyond the window
    "prefill-window-fresh": Case("prefill", 3, 6, 2, 23, 16, 61, (0, 0, 0), config=SMALL_PREFILL, window=5),
    "prefill-window-chunked": Case("prefill", 3, 6, 2, 23, 32, 61, (0, 9, 33), config=SMALL_PREFILL, window=20),
    "prefill-window-long": Case("prefill", 2, 4, 1, 9, 16, 61, (3, 40), config=SMALL_PREFILL, window=37),
    "prefill-window-table-config": Case("prefill", 2, 6, 2, 13, 32, 37, (0, 4), window=7),
    # the sm_90 table's tile shape at G = 4 (Llama/Mistral: 32 / 8 heads), scaled down: a fresh
    # prompt longer than the window (window a multiple of BLOCK_N, many key tiles per program)
    # and chunked prompts whose window reaches past the cached prefix / cuts it
    "prefill-window-sm90-fresh": Case("prefill", 1, 8, 2, 300, 16, 320, (0,), config=SM90_PREFILL, window=128),
    "prefill-window-sm90-chunked": Case("prefill", 2, 8, 2, 100, 16, 512, (93, 300), config=SM90_PREFILL, window=256),
    # G > BLOCK_M: each token's rows straddle two row tiles, and a token that starts a tile
    # (j_lo = i_min) sits right below a key-tile edge (i_min + 1 = 16): it must still be written
    "prefill-mqa-straddle": Case("prefill", 2, 32, 1, 20, 16, 40, (0, 3), config=SMALL_PREFILL),
    "prefill-mqa-straddle-window": Case("prefill", 2, 32, 1, 20, 16, 40, (0, 3), config=SMALL_PREFILL, window=6),
    "decode-window": Case("decode", 3, 6, 2, 1, 16, 61, (3, 30, 60), config=SMALL_DECODE, num_splits=3, window=20),
    "decode-window-one-split": Case("decode", 3, 6, 2, 1, 16, 61, (3, 30, 60), window=9),
    "decode-window-many-splits": Case(
        "decode", 2, 4, 2, 1, 16, 70, (36, 69), config=SMALL_DECODE, num_splits=7, window=33
    ),
    # rotary fused into decode (random cos / sin, whose halves differ: a wrong partner column shows)
    "decode-rotary-one-split": Case("decode", 3, 6, 2, 1, 16, 37, (0, 20, 36), rotary=True),
    # 3 splits: the keys of pos 0 and 13 fit in the first (the single-split path), 20's and 36's take 2 and 3
    "decode-rotary-splits": Case(
        "decode", 4, 6, 2, 1, 16, 37, (0, 13, 20, 36), config=SMALL_DECODE, num_splits=3, rotary=True
    ),
    "decode-rotary-mha": Case("decode", 2, 3, 3, 1, 32, 37, (11, 30), config=SMALL_DECODE, num_splits=2, rotary=True),
    "decode-rotary-mqa": Case("decode", 2, 8, 1, 1, 16, 37, (2, 35), config=SMALL_DECODE, num_splits=3, rotary=True),
    "decode-rotary-d48": Case("decode", 2, 4, 2, 1, 48, 37, (9, 36), config=SMALL_DECODE, num_splits=3, rotary=True),
    "decode-rotary-window": Case(
        "decode", 3, 6, 2, 1, 16, 61, (3, 30, 60), config=SMALL_DECODE, num_splits=3, window=20, rotary=True
    ),
    "decode-rotary-overflow": Case(
        "decode", 3, 6, 2, 1, 16, 37, (37, 50, 15), config=SMALL_DECODE, num_splits=3, rotary=True
    ),
    "decode-rotary-fused-qkv": Case(
        "decode", 2, 8, 2, 1, 32, 61, (5, 40), config=SMALL_DECODE, num_splits=2, fused_qkv=True, rotary=True
    ),
    # PRE_N: each split's first keys as one tile loaded before the PDL wait (the interpreter has
    # no PDL; the tile is the same with and without it). A loop tile's size (pos 0: the new token
    # opens the split, the tile all masked), two loop tiles' (longer than some splits: pos 20's
    # 2 splits of 16 keys), a window, rotary, past the cache's end, the single-split path
    "decode-preload-tile": Case(
        "decode", 3, 6, 2, 1, 16, 37, (0, 20, 36), config=dict(SMALL_DECODE, PRE_N=16), num_splits=3
    ),
    "decode-preload-two-tiles": Case(
        "decode", 3, 6, 2, 1, 16, 61, (0, 20, 60), config=dict(SMALL_DECODE, PRE_N=32), num_splits=3
    ),
    "decode-preload-window-rotary": Case(
        "decode",
        3,
        6,
        2,
        1,
        16,
        61,
        (3, 30, 60),
        num_splits=3,
        window=20,
        config=dict(SMALL_DECODE, PRE_N=32),
        rotary=True,
    ),
    # rot_pos: the kernel reads cos / sin rows of [P, D] tables itself (fuse_rotary_attention's
    # form where they were fold_position_tables' lookups); rows other than the cache positions
    # (the op allows any), before the PDL wait, also with splits, a window and the preloaded tile
    "decode-rotary-table": Case("decode", 3, 6, 2, 1, 16, 37, (0, 20, 36), rotary=True, rot_table=True),
    "decode-rotary-table-splits": Case(
        "decode",
        4,
        6,
        2,
        1,
        32,
        61,
        (0, 13, 40, 60),
        num_splits=3,
        window=20,
        config=dict(SMALL_DECODE, PRE_N=32),
        rotary=True,
        rot_table=True,
    ),
    "decode-preload-overflow": Case(
        "decode", 3, 6, 2, 1, 16, 37, (37, 50, 15), num_splits=3, config=dict(SMALL_DECODE, PRE_N=32)
    ),
    "decode-preload-one-split": Case(
        "decode",
        3,
        6,
        2,
        1,
        16,
        37,
        (0, 20, 36),
        rotary=True,
        config=dict(BLOCK_N=16, num_warps=4, num_stages=1, MIN_SPLIT=64, PROGRAMS_PER_SM=2, PRE_N=32),
    ),
}
DTYPES = ("float32", "float16")
# the prefill variant's launch-config keys, each run on every unwindowed prefill case. A windowed
# call runs the default code whatever the keys (prefill_attention), so one windowed case checks
# that the wrapper ignores them there; TMA is for 16-bit tensors only, so in fp32 "tma" is the
# default kernel and "tma-defer-pv" is "defer-pv": fp32 runs "defer-pv" alone
VARIANTS = {"tma": dict(TMA=True), "defer-pv": dict(DEFER_PV=True), "tma-defer-pv": dict(TMA=True, DEFER_PV=True)}
VARIANT_DTYPES = {"tma": ("float16",), "defer-pv": DTYPES, "tma-defer-pv": ("float16",)}
PREFILL_CASES = [
    name
    for name, case in CASES.items()
    if case.kind == "prefill" and (not case.window or name == "prefill-window-chunked")
]
VARIANT_RUNS = [
    (name, variant, dtype) for name in PREFILL_CASES for variant in VARIANTS for dtype in VARIANT_DTYPES[variant]
]
TOL = {"float32": 2e-5, "float16": 2e-3}  # max |kernel - fp32 reference| / max(1, |reference|)


def with_variant(case: Case, flags: dict) -> Case:
    """The case with the variant's keys added to its launch config (the table's if it has none)."""
    from dataclasses import replace

    from dsc.kernels import attention as A

    return replace(case, config={**(case.config or A.attention_config("prefill", case.D, "default")), **flags})


def run_case(case: Case, dtype: torch.dtype) -> str:
    """Run one case in the interpreter; "ok" or what went wrong."""
    from dsc.kernels import attention as A

    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, S, D, Smax = case.B, case.H, case.Hkv, case.S, case.D, case.Smax
    Bmax = case.Bmax or B + 1
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    if case.fused_qkv:
        qkv = rand(B, S, (H + 2 * Hkv) * D)
        q, k, v = (
            qkv[..., a * D : (a + n) * D].view(B, S, n, D).transpose(1, 2)
            for a, n in ((0, H), (H, Hkv), (H + Hkv, Hkv))
        )
    else:
        q, k, v = rand(B, H, S, D), rand(B, Hkv, S, D), rand(B, Hkv, S, D)
    k_cache, v_cache = rand(Bmax, Hkv, Smax, D), rand(Bmax, Hkv, Smax, D)
    cache_pos = torch.tensor(case.cache_pos, dtype=torch.int64)
    cos_sin = (rand(B, S, D).clamp(-1, 1), rand(B, S, D).clamp(-1, 1)) if case.rotary else None
    rot_pos, tables = None, None
    if case.rot_table:  # tables of Smax + 5 rows; each sequence's row drawn apart from its position
        tables = (rand(Smax + 5, D).clamp(-1, 1), rand(Smax + 5, D).clamp(-1, 1))
        rot_pos = torch.randint(0, Smax + 5, (B, S), generator=gen)
        cos_sin = (tables[0][rot_pos], tables[1][rot_pos])
    # what attention sees: dsc.rotary's outputs (in q's dtype, as that kernel stores them)
    q_in, k_in = A.rotary_reference(q, k, *cos_sin) if case.rotary else (q, k)
    # poison: cache slots no query of this call may read (past each sequence's last token, and
    # rows >= B) and the output; NaN anywhere they leak shows in the result
    end = cache_pos[:, None] + S  # [B, 1]
    unread = torch.ones(Bmax, Smax, dtype=torch.bool)
    unread[:B] = torch.arange(Smax)[None, :] >= end
    if case.window:  # below the first new token's window
        unread[:B] |= torch.arange(Smax)[None, :] <= cache_pos[:, None] - case.window
    k_cache.masked_fill_(unread[:, None, :, None], float("nan"))
    v_cache.masked_fill_(unread[:, None, :, None], float("nan"))
    out = torch.full((B, S, H, D), float("nan"), dtype=dtype)
    variant = dict(softcap=case.softcap, alibi_slopes=alibi_slopes_for(H) if case.alibi else None)

    want_k, want_v = k_cache.clone(), v_cache.clone()
    twin_k, twin_v = k_cache.clone(), v_cache.clone()  # for the unfused kernels (rotary cases)
    A.write_kv_cache_reference(k_in, v, want_k, want_v, cache_pos)
    ref = A.attention_reference(
        q_in.float(),
        k_in.float(),
        v.float(),
        k_cache.float().nan_to_num(),
        v_cache.float().nan_to_num(),
        cache_pos,
        D**-0.5,
        case.window,
        **variant,
    )

    if case.kind == "prefill":
        A.prefill_attention(
            q, k, v, k_cache, v_cache, cache_pos, D**-0.5, case.window, out=out, config=case.config, **variant
        )
    else:
        A.decode_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            cache_pos,
            D**-0.5,
            case.window,
            rotary=tables or cos_sin,
            rot_pos=rot_pos,
            out=out,
            config=case.config,
            num_splits=case.num_splits,
            **variant,
        )
    problems = []
    for name, got, want in (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)):
        if not torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)):
            bad = (got.nan_to_num(7.0) != want.nan_to_num(7.0)).nonzero()[:3].tolist()
            problems.append(f"{name} differs from the reference write at [b, h, s, d] {bad}")
    if out.isnan().any():
        problems.append(f"out has NaN at [b, s, h, d] {out.isnan().nonzero()[:3].tolist()}")
    if case.rotary:  # dsc.rotary's kernel, then the plain decode kernel: the same bits, out and cache
        twin = A.decode_attention(
            *A.rotary_triton(q, k, *cos_sin),
            v,
            twin_k,
            twin_v,
            cache_pos,
            D**-0.5,
            case.window,
            config=case.config,
            num_splits=case.num_splits,
            **variant,
        )
        if not (torch.equal(out, twin) and torch.equal(k_cache.nan_to_num(7.0), twin_k.nan_to_num(7.0))):
            problems.append("out or k_cache differs from the unfused kernels' (rotary, then decode attention)")
    err = ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
    if not err <= TOL[str(dtype).removeprefix("torch.")]:
        problems.append(f"out: relative max error {err:.3g}")
    return "; ".join(problems) or "ok"


def _worker() -> None:
    """Child process: every case in the interpreter; prints {"<case>/<dtype>": "ok" | problem}."""
    torch.set_num_threads(1)
    report = {}
    for name, case in CASES.items():
        for dtype in DTYPES:
            try:
                report[f"{name}/{dtype}"] = run_case(case, getattr(torch, dtype))
            except Exception as e:  # reported per case by the parent, not swallowed
                report[f"{name}/{dtype}"] = f"raised {type(e).__name__}: {e}"
    for name, variant, dtype in VARIANT_RUNS:
        try:
            report[f"{name}+{variant}/{dtype}"] = run_case(
                with_variant(CASES[name], VARIANTS[variant]), getattr(torch, dtype)
            )
        except Exception as e:  # reported per case by the parent, not swallowed
            report[f"{name}+{variant}/{dtype}"] = f"raised {type(e).__name__}: {e}"
    # every split counter is back at 0 after the launches (the next step, or graph replay,
    # starts from there); the split cases above allocated them
    from dsc.kernels import launch

    counters = list(launch.COUNTERS.values())
    report["split-counters-reset"] = (
        "ok"
        if counters and all(bool((c == 0).all()) for c in counters)
        else f"counters {[c.nonzero().flatten().tolist()[:8] for c in counters]}"
    )
    report["single-split-skips-counter"] = _single_split_skips_counter((0, 9, 15))
    # 17-23 keys at a floor of 16: the sliver past the first 16 joins the first split
    report["sliver-joins-first-split"] = _single_split_skips_counter((16, 20, 22))
    report["preload-of-a-loop-tile-same-bits"] = _preload_same_bits()
    print("REPORT " + json.dumps(report))


def _preload_same_bits() -> str:
    """A preloaded tile of BLOCK_N keys (PRE_N == BLOCK_N) is the loop's first tile: out and the
    cache are bit-equal to the kernel's without it (3 splits, positions 0 / 20 / 36, fp16)."""
    from dsc.kernels import attention as A

    gen = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(torch.float16)  # noqa: E731
    q, k, v = rand(3, 6, 1, 16), rand(3, 2, 1, 16), rand(3, 2, 1, 16)
    caches = rand(4, 2, 37, 16), rand(4, 2, 37, 16)
    pos = torch.tensor([0, 20, 36])
    got = []
    for pre in (0, SMALL_DECODE["BLOCK_N"]):
        kc, vc = caches[0].clone(), caches[1].clone()
        out = A.decode_attention(q, k, v, kc, vc, pos, 0.25, config=dict(SMALL_DECODE, PRE_N=pre), num_splits=3)
        got.append((out, kc, vc))
    same = all(torch.equal(a, b) for a, b in zip(*got))
    return "ok" if same else "out or the caches differ with the first tile preloaded"


def _single_split_skips_counter(positions: tuple[int, ...]) -> str:
    """Every sequence of the batch (at `positions`) has all its keys in the first of 3 splits:
    that split writes out itself and leaves the shared split counters alone. They are preset to
    7 here, so a split that took its counter would see done = 7, not n_written - 1 = 0, and
    never write out (NaN)."""
    from dsc.kernels.launch import split_counters

    case = Case("decode", 3, 6, 2, 1, 16, 37, positions, config=SMALL_DECODE, num_splits=3)
    counters = split_counters(torch.device("cpu"), case.B * case.Hkv)
    counters.fill_(7)
    result = run_case(case, torch.float32)
    if result == "ok" and not bool((counters == 7).all()):
        result = f"counters changed: {counters[: case.B * case.Hkv].tolist()}"
    counters.zero_()
    return result


def _compile_sm90() -> None:
    """Child process: compile every kernel for sm_90 with triton.compile (no GPU, no launch)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsc.kernels import attention as A
    from dsc.kernels import attention_sm90 as W
    from dsc.kernels import rotary as R
    from dsc.kernels.launch import triton_jit
    from dsc.kernels.rotary import ROTATE_OPTIONS, rotary_config

    A._triton()
    rotary_kernel = triton_jit(R._rotary_kernel)  # the JITFunction rotary_triton launches

    def compile_(fn, ptr_types, consts, **options):
        consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
        # the prefill kernel's TMA descriptors, the decode kernel's rotary tables and their strides:
        # None (a constexpr) unless the build gives their types
        consts |= {
            n: None
            for n in ("KD", "VD", "KCD", "VCD", "COS", "SIN", "sc_b", "ss_b", "RPOS", "srp_b", "SLOPES")
            if n in fn.arg_names and n not in ptr_types
        }
        sig = {
            n: "constexpr" if n in consts else ptr_types.get(n, "fp32" if n in ("qk_scale", "cap") else "i32")
            for n in fn.arg_names
        }
        # what a launch specializes on at Llama's shapes: 16-byte aligned pointers, strides that
        # are multiples of 16 elements (without it the loads are not vectorized, so not pipelined)
        stride = lambda n: n.startswith("s") and "_" in n and not n.startswith("sl_")  # noqa: E731
        aligned = {
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(fn.arg_names)
            if n not in consts and (ptr_types.get(n, "").startswith("*") or stride(n))
        }
        return triton.compile(
            ASTSource(fn, sig, constexprs=consts, attrs=aligned), target=GPUTarget("cuda", 90, 32), options=options
        )

    report = {}
    for dtype in ("fp16", "bf16"):
        keep = lambda name: dtype == "bf16" or name in FP16_BUILDS  # noqa: E731
        t = {n: f"*{dtype}" for n in ("Q", "K", "V", "KC", "VC", "OUT")} | {"POS": "*i64"}
        f32 = {"PART_O": "*fp32", "PART_LSE": "*fp32", "LOCK": "*i32"}
        rot = {"COS": f"*{dtype}", "SIN": f"*{dtype}", "sc_b": "i32", "ss_b": "i32"}  # cos/sin [B, 1, 128]
        rot_table = rot | {"RPOS": "*i64", "srp_b": "i32"}  # cos/sin tables [P, 128], rot_pos [B, 1]
        pre, dec = A.PREFILL_CONFIGS[("sm_90", 128)], A.DECODE_CONFIGS[("sm_90", 128)]
        pre64 = A.PREFILL_CONFIGS[("sm_90", 64)]
        dec_pre = dec.get("PRE_N", 0)
        table_descs = {n: f"tensordesc<{dtype}[1, 1, {pre['BLOCK_N']}, 128]>" for n in ("KD", "VD", "KCD", "VCD")}
        jobs = {  # the sm_90 table entries at Llama-8B's shapes (G = 32 / 8), plus a padded head_dim
            "prefill": (
                A._prefill_kernel,
                t | (table_descs if pre.get("TMA") else {}),
                dict(
                    G=4,
                    HEAD_DIM=128,
                    BLOCK_D=128,
                    BLOCK_M=pre["BLOCK_M"],
                    BLOCK_N=pre["BLOCK_N"],
                    WINDOWED=False,
                    TMA=pre.get("TMA", False),
                    DEFER_PV=pre.get("DEFER_PV", False),
                ),
                dict(num_warps=pre["num_warps"], num_stages=pre["num_stages"]),
            ),
            # a 128-key tile (a --sweep candidate): 3 stages of K and V tiles fill the shared memory
            "prefill-n128": (
                A._prefill_kernel,
                t,
                dict(G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=128, WINDOWED=False),
                dict(num_warps=8, num_stages=3),
            ),
            "decode": (
                A._decode_kernel,
                t | f32,
                dict(
                    G=4,
                    HEAD_DIM=128,
                    BLOCK_D=128,
                    BLOCK_H=16,
                    SPLIT=True,
                    BLOCK_N=dec["BLOCK_N"],
                    WINDOWED=False,
                    PRE_N=dec_pre,
                ),
                dict(num_warps=dec["num_warps"], num_stages=dec["num_stages"]),
            ),
            # the kernel without the preloaded tile (PRE_N=0)
            "decode-pre0": (
                A._decode_kernel,
                t | f32,
                dict(
                    G=4,
                    HEAD_DIM=128,
                    BLOCK_D=128,
                    BLOCK_H=16,
                    SPLIT=True,
                    BLOCK_N=dec["BLOCK_N"],
                    WINDOWED=False,
                    PRE_N=0,
                ),
                dict(num_warps=4, num_stages=dec["num_stages"]),
            ),
            "decode-d80": (
                A._decode_kernel,
                t | f32,
                dict(G=1, HEAD_DIM=80, BLOCK_D=128, BLOCK_H=16, SPLIT=False, BLOCK_N=64, WINDOWED=False),
                dict(num_warps=4, num_stages=2),
            ),
            # sliding window (Mistral's shapes: 32 heads, 8 kv heads, head_dim 128)
            "prefill-window": (
                A._prefill_kernel,
                t,
                dict(G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=pre["BLOCK_M"], BLOCK_N=pre["BLOCK_N"], WINDOWED=True),
                dict(num_warps=pre["num_warps"], num_stages=pre["num_stages"]),
            ),
            "decode-window": (
                A._decode_kernel,
                t | f32,
                dict(
                    G=4,
                    HEAD_DIM=128,
                    BLOCK_D=128,
                    BLOCK_H=16,
                    SPLIT=True,
                    BLOCK_N=dec["BLOCK_N"],
                    WINDOWED=True,
                    PRE_N=dec_pre,
                ),
                dict(num_warps=dec["num_warps"], num_stages=dec["num_stages"]),
            ),
            # dsc.rotary_attention's decode kernel (Llama-8B: G = 4 at tp 1 and tp 4; Mistral's window)
            "decode-rotary": (
                A._decode_kernel,
                t | f32 | rot,
                dict(
                    G=4,
                    HEAD_DIM=128,
                    BLOCK_D=128,
                    BLOCK_H=16,
                    SPLIT=True,
                    BLOCK_N=dec["BLOCK_N"],
                    WINDOWED=False,
                    ROTARY=True,
                    PRE_N=dec_pre,
                ),
                dict(num_warps=dec["num_warps"], num_stages=dec["num_stages"]),
            ),
            # with rot_pos: the tables' rows read in the kernel, before the PDL wait
            "decode-rotary-table": (
                A._decode_kernel,
                t | f32 | rot_table,
                dict(
                    G=4,
                    HEAD_DIM=128,
                    BLOCK_D=128,
                    BLOCK_H=16,
                    SPLIT=True,
                    BLOCK_N=dec["BLOCK_N"],
                    WINDOWED=False,
                    ROTARY=True,
                    ROT_TABLE=True,
                    PRE_N=dec_pre,
                ),
                dict(num_warps=dec["num_warps"], num_stages=dec["num_stages"]),
            ),
            "decode-rotary-window": (
                A._decode_kernel,
                t | f32 | rot,
                dict(
                    G=4,
                    HEAD_DIM=128,
                    BLOCK_D=128,
                    BLOCK_H=16,
                    SPLIT=True,
                    BLOCK_N=dec["BLOCK_N"],
                    WINDOWED=True,
                    ROTARY=True,
                    PRE_N=dec_pre,
                ),
                dict(num_warps=dec["num_warps"], num_stages=dec["num_stages"]),
            ),
            # one query head per kv head (GPT-2: head_dim 64): 128 row tokens span 3 key tiles of 64
            "prefill-mha": (
                A._prefill_kernel,
                t,
                dict(G=1, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=pre64["BLOCK_M"], BLOCK_N=pre64["BLOCK_N"], WINDOWED=False),
                dict(num_warps=pre64["num_warps"], num_stages=pre64["num_stages"]),
            ),
        }
        # the decode kernel with PDL (kernels/launch.py): griddepcontrol.wait before any memory access
        jobs.update(
            {
                f"{name}-pdl": (fn, ptrs, {**consts, "PDL": True}, options)
                for name, (fn, ptrs, consts, options) in jobs.items()
                if name.startswith("decode")
            }
        )
        # the prefill variant's candidate rows: Llama's G = 4 at head_dim 128, GPT-2's G = 1 at 64
        for (_arch, head_dim), rows in A.PREFILL_VARIANTS.items():
            for cfg in rows:
                if cfg.get("WS"):  # the warp-specialized kernel's rows: the prefill-ws builds below
                    continue
                G = 4 if head_dim == 128 else 1
                block = f"tensordesc<{dtype}[1, 1, {cfg['BLOCK_N']}, {head_dim}]>"
                descs = {n: block for n in ("KD", "VD", "KCD", "VCD")}
                jobs[variant_job(cfg, G)] = (
                    A._prefill_kernel,
                    t | (descs if cfg.get("TMA") else {}),
                    dict(
                        G=G,
                        HEAD_DIM=head_dim,
                        BLOCK_D=head_dim,
                        BLOCK_M=cfg["BLOCK_M"],
                        BLOCK_N=cfg["BLOCK_N"],
                        WINDOWED=False,
                        TMA=cfg.get("TMA", False),
                        DEFER_PV=cfg.get("DEFER_PV", False),
                    ),
                    dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
                )
        # dsc.rotary's kernel at Llama-8B's heads (32 / 8, 4 heads per program), as rotary_triton launches it
        rcfg = rotary_config(128, "sm_90")
        jobs["rotary"] = (
            rotary_kernel,
            {n: f"*{dtype}" for n in ("Q", "K", "COS", "SIN", "QO", "KO")}
            | {"sc_b": "i32", "ss_b": "i32"},  # (strides here, not the decode kernel's tables)
            dict(BLOCK_H=rcfg["BLOCK_H"], BLOCK_D=rcfg["BLOCK_D"]),
            dict(num_warps=rcfg["num_warps"]),
        )
        for name, (fn, ptrs, consts, options) in jobs.items():
            if not keep(name):
                continue
            if name.startswith(("decode", "rotary")):  # the runtime's launch options (no FP contraction)
                options = {**options, **ROTATE_OPTIONS}
            try:
                kernel = compile_(fn, ptrs, consts, **options)
                report[f"{name}/{dtype}"] = "ok"
                if name in ("prefill-window", "prefill-mha") or name.startswith("prefill-mha-variant"):
                    report[f"{name}-pipelining/{dtype}"] = _check_no_store_in_pipelined_loop(kernel.asm["ttgir"])
                if name == "prefill" or name.startswith(("prefill-variant", "prefill-mha-variant")):
                    report[f"{name}-ptxas/{dtype}"] = _check_ptxas(kernel, allow_spills=name == "prefill")
                if name.startswith("decode"):
                    # the position and the preloaded tile (cache slots below it) may load before the wait
                    early = {"load pos", "load k_pre", "load v_pre"} if consts.get("PRE_N") else {"load pos"}
                    if consts.get("ROT_TABLE"):  # the rotary tables' rows (constants) and their index (an input)
                        early |= {"load row", "load cos", "load sin"}
                    report[f"{name}-gdc/{dtype}"] = pdl_check(kernel, consts.get("PDL", False), frozenset(early))
                    report[f"{name}-ptxas/{dtype}"] = _check_ptxas(kernel, allow_spills=False)
                if name.startswith(("decode", "rotary")):
                    # a contracted mul + add: fma.rn.{f32,bf16,f16}[x2] (the ftz f32 FMAs are exp2's and
                    # the division's own lowering, there without contraction too)
                    fmas = sorted(set(re.findall(r"\bfma\.rn\.(?:bf16|f16|f32)(?:x2)?\b", kernel.asm["ptx"])))
                    report[f"{name}-contract/{dtype}"] = "ok" if not fmas else f"contracted: {fmas}"

            except Exception as e:  # reported per kernel by the parent
                report[f"{name}/{dtype}"] = f"raised {type(e).__name__}: {e}"[:2000]
        # the warp-specialized Gluon prefill (kernels/attention_sm90.py) at its table's tiles
        for name, (G, head_dim, config) in WS_BUILDS.items():
            if not keep(name):
                continue
            try:
                kernel = W.compile_for_sm90(dtype, G, head_dim, config)
                report[f"{name}/{dtype}"] = "ok"
                report[f"{name}-ptxas/{dtype}"] = _check_ptxas(kernel, allow_spills=False)
                report[f"{name}-regs/{dtype}"] = _check_register_split(kernel.asm["ptx"])
            except Exception as e:
                report[f"{name}/{dtype}"] = f"raised {type(e).__name__}: {e}"[:2000]
    # fp32 at head_dim 128 (an 8B-shaped model compiled in fp32): the table's 16-bit rows need
    # more shared memory than a block gets; attention_config shrinks them for 4-byte elements
    t = {n: "*fp32" for n in ("Q", "K", "V", "KC", "VC", "OUT", "PART_O", "PART_LSE")} | {"POS": "*i64", "LOCK": "*i32"}
    for kind, fn in (("prefill", A._prefill_kernel), ("decode", A._decode_kernel)):
        cfg = A.attention_config(kind, 128, "sm_90", itemsize=4)
        consts = dict(G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=cfg["BLOCK_N"], WINDOWED=False)
        consts |= dict(BLOCK_M=cfg["BLOCK_M"]) if kind == "prefill" else dict(BLOCK_H=16, SPLIT=True)
        try:
            kernel = compile_(
                fn,
                {k: v for k, v in t.items() if kind == "decode" or k not in ("PART_O", "PART_LSE", "LOCK")},
                consts,
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
            )
            shared = kernel.metadata.shared
            report[f"{kind}-fp32-d128-smem"] = (
                "ok" if shared <= 232448 else f"{shared} bytes of shared memory > 227 KiB"
            )
        except Exception as e:
            report[f"{kind}-fp32-d128-smem"] = f"raised {type(e).__name__}: {e}"[:2000]
    print("REPORT " + json.dumps(report))


# the builds also made in fp16 (all are made in bf16, what the 8B-class models run): fp16 and
# bf16 builds of one kernel take the same constexprs and differ in the element type only. fp16
# keeps the table's default prefill and decode (PDL too), the warp-specialized prefill at
# Llama's shapes, and both kernels that rotate (their FP contraction is per element type)
FP16_BUILDS = {"prefill", "decode", "decode-pdl", "rotary", "decode-rotary", "decode-rotary-pdl", "prefill-ws"}


def sm90_dtypes(kernel: str) -> list[str]:
    return ["fp16", "bf16"] if kernel in FP16_BUILDS else ["bf16"]


def sm90_params(kernels) -> list:
    """(kernel, dtype) for each build the sm_90 child makes of these kernels."""
    return [pytest.param(k, d, id=f"{d}-{k}") for k in kernels for d in sm90_dtypes(k)]


# the warp-specialized prefill's sm_90 builds: (G, head_dim, config overrides); Llama-8B's
# 32 / 8 heads, a GQA of 8, GPT-2's one head per kv head at 64, and the 64-key variant row
WS_BUILDS = {
    "prefill-ws": (4, 128, None),
    "prefill-ws-g8": (8, 128, None),
    "prefill-ws-mha-d64": (1, 64, None),
    "prefill-ws-n64": (4, 128, dict(BLOCK_N=64, K_STAGES=4, V_STAGES=4)),
}


def _check_register_split(ptx: str) -> str:
    """ "ok" if the build hands registers from the producer to the two consumer warpgroups
    (setmaxnreg: the producer down to a few, the consumers up past the even split of the CTA's
    registers) and the three together fit what the CTA is launched with (.maxnreg x .reqntid):
    a setmaxnreg.inc that cannot be served waits forever."""
    import re

    counts = {(op, int(n)) for op, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}
    even = int(re.search(r"\.maxnreg\s+(\d+)", ptx).group(1))
    budget = even * int(re.search(r"\.reqntid\s+(\d+)", ptx).group(1)) // 128  # per thread of a warpgroup
    up = sorted(n for op, n in counts if op == "inc" and n > even)
    down = sorted(n for op, n in counts if op == "dec" and n < 64)
    if not up or not down:
        return f"no register split: setmaxnreg {sorted(counts)}"
    used = up[-1] + (up[-2] if len(up) > 1 else up[-1]) + down[0]
    return "ok" if used <= budget else f"{used} registers per warpgroup thread > {budget}: {sorted(counts)}"


def variant_job(cfg: dict, G: int) -> str:
    """The sm_90 build name of a PREFILL_VARIANTS row, e.g. prefill-variant-128x64-w8-s3-tma-defer_pv."""
    keys = "".join(f"-{k.lower()}" for k in ("TMA", "DEFER_PV") if cfg.get(k))
    return (
        f"prefill-{'mha-' if G == 1 else ''}variant-{cfg['BLOCK_M']}x{cfg['BLOCK_N']}-w{cfg['num_warps']}"
        f"-s{cfg['num_stages']}{keys}"
    )


def _check_ptxas(kernel, allow_spills: bool) -> str:
    """ "ok" unless ptxas (the one this triton runs for sm_90) serializes the build's wgmmas, or
    spills registers (allow_spills: the default build spills 4 bytes).  Either undoes the point of
    the prefill variant, and neither shows in the TTGIR: a register copy at a loop's back edge of
    a wgmma still in flight (the look-ahead QK^T this variant first tried) makes ptxas wait after
    every wgmma in the kernel."""
    import re
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(kernel.asm["ptx"])
        proc = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", str(Path(d, "k.ptx")), "-o", str(Path(d, "k.cubin"))],
            capture_output=True,
            text=True,
        )
    log = proc.stdout + proc.stderr
    problems = [ln.strip()[:200] for ln in log.splitlines() if "serialized" in ln][:1]
    if proc.returncode:
        problems.append(f"ptxas failed: {log[-300:]}")
    if not allow_spills and any(int(n) for n in re.findall(r"(\d+) bytes spill stores", log)):
        problems.append("register spills: " + "; ".join(ln.strip() for ln in log.splitlines() if "spill" in ln)[:200])
    return "; ".join(problems) or "ok"


def _check_no_store_in_pipelined_loop(ttgir: str) -> str:
    """ "ok" unless a software-pipelined loop (one issuing async global->shared copies, TMA ones
    included) also stores to global memory.  A K/V tile that feeds the async wgmma and is also
    stored (the cache write fused into the attention loop) gets one shared-memory buffer too few
    from Triton's pipeliner: the copy of tile i + num_stages - 1 overwrites tile i's V while the
    p @ v wgmma still reads it (wrong outputs on an H200 in the windowed loop, which runs
    window / BLOCK_N tiles).  The interpreter cannot see this, so the compiled IR is checked."""
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for inner in lines[i + 1 :]:
            if inner.strip().startswith("}") and len(inner) - len(inner.lstrip()) == indent:
                break
            body.append(inner)
        text = "\n".join(body)
        if ("async_copy_global_to_local" in text or "async_tma_copy_global_to_local" in text) and "tt.store" in text:
            return f"pipelined loop with a global store: {line.strip()[:160]}"
    return "ok"


def _run_child(mode: str, interpret: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    if proc.returncode or not lines:
        pytest.fail(f"{mode} child failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1].removeprefix("REPORT "))


@pytest.fixture(scope="module")
def interpreter_report():
    pytest.importorskip("triton")
    return _run_child("interpret", interpret=True)


@pytest.fixture(scope="module")
def sm90_report():
    pytest.importorskip("triton")
    return _run_child("compile-sm90", interpret=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(interpreter_report, case, dtype):
    assert interpreter_report[f"{case}/{dtype}"] == "ok"


@pytest.mark.parametrize("case, variant, dtype", VARIANT_RUNS)
def test_prefill_variant_matches_reference(interpreter_report, case, variant, dtype):
    assert interpreter_report[f"{case}+{variant}/{dtype}"] == "ok"


def test_split_counters_are_reset_by_each_launch(interpreter_report):
    assert interpreter_report["split-counters-reset"] == "ok"


def test_single_split_writes_out_without_the_counter(interpreter_report):
    assert interpreter_report["single-split-skips-counter"] == "ok"


def test_a_sliver_of_keys_joins_the_first_split(interpreter_report):
    assert interpreter_report["sliver-joins-first-split"] == "ok"


def test_preloading_a_loop_tile_keeps_the_bits(interpreter_report):
    assert interpreter_report["preload-of-a-loop-tile-same-bits"] == "ok"


DECODE_BUILDS = [
    "decode",
    "decode-pre0",
    "decode-d80",
    "decode-window",
    "decode-rotary",
    "decode-rotary-table",
    "decode-rotary-window",
]


@pytest.mark.parametrize(
    "kernel, dtype",
    sm90_params(
        [
            "prefill",
            "prefill-n128",
            "prefill-window",
            "prefill-mha",
            "rotary",
            *DECODE_BUILDS,
            *(f"{name}-pdl" for name in DECODE_BUILDS),
        ]
    ),
)
def test_kernel_compiles_for_sm90(sm90_report, kernel, dtype):
    """Every kernel build in bf16; the FP16_BUILDS in fp16 too."""
    assert sm90_report[f"{kernel}/{dtype}"] == "ok"


@pytest.mark.parametrize("kernel, dtype", sm90_params(DECODE_BUILDS))  # (FP16_BUILDS holds both or neither)
def test_decode_pdl_waits_before_any_memory_access(sm90_report, kernel, dtype):
    """With PDL the decode kernel waits for the previous kernel before it reads q, k, v, cos / sin,
    the counters or the partials and before any store; before the wait it reads only cache_pos,
    (PRE_N) the preloaded tile's cache slots and (ROT_TABLE) the rotary tables' rows and rot_pos,
    which no kernel of this step writes. Without
    PDL it has no griddepcontrol instruction."""
    assert sm90_report[f"{kernel}-gdc/{dtype}"] == "ok"
    assert sm90_report[f"{kernel}-pdl-gdc/{dtype}"] == "ok"


@pytest.mark.parametrize("kernel, dtype", sm90_params([*DECODE_BUILDS, *(f"{name}-pdl" for name in DECODE_BUILDS)]))
def test_decode_builds_do_not_spill(sm90_report, kernel, dtype):
    """ptxas keeps every decode build (the rotary one's second q load and cos / sin included) in registers."""
    assert sm90_report[f"{kernel}-ptxas/{dtype}"] == "ok"


@pytest.mark.parametrize("kernel, dtype", sm90_params(["rotary", *DECODE_BUILDS]))
def test_rotation_is_not_contracted_on_sm90(sm90_report, kernel, dtype):
    """dsc.rotary's kernel and the decode kernel (which rotates with ROTARY) build without FP
    contraction: with it, LLVM turned rotate's bf16(bf16(x cos) + bf16(r sin)) into
    fma.rn.bf16(x, cos, bf16(r sin)), and the two kernels fused different products (an H200 gave
    an ulp's difference in ~10% of elements). No fma in the PTX."""
    assert sm90_report[f"{kernel}-contract/{dtype}"] == "ok"


@pytest.mark.parametrize("kernel, dtype", sm90_params(["prefill-window", "prefill-mha"]))
def test_long_prefill_loops_store_outside_pipelined_loops(sm90_report, kernel, dtype):
    """The prefill kernel at the sm_90 table configs, where a loop that loads K/V can run past
    2 tiles (a sliding window; one query head per kv head, G = 1): no cache store in a
    pipelined loop. (Llama's G = 4 keeps the write in its at most 2 masked tiles.)"""
    assert sm90_report[f"{kernel}-pipelining/{dtype}"] == "ok"


def _variant_jobs():
    from dsc.kernels.attention import PREFILL_VARIANTS

    return [
        variant_job(cfg, 4 if head_dim == 128 else 1)
        for (_, head_dim), rows in PREFILL_VARIANTS.items()
        for cfg in rows
        if not cfg.get("WS")
    ]


@pytest.mark.parametrize("kernel, dtype", sm90_params(_variant_jobs()))
def test_prefill_variant_compiles_for_sm90(sm90_report, kernel, dtype):
    """Every candidate row of the prefill variant builds for sm_90, without register spills or
    serialized wgmmas (ptxas); at G = 1 no cache store sits in a pipelined loop."""
    assert sm90_report[f"{kernel}/{dtype}"] == "ok"
    assert sm90_report[f"{kernel}-ptxas/{dtype}"] == "ok"
    if "-mha-" in kernel:
        assert sm90_report[f"{kernel}-pipelining/{dtype}"] == "ok"


@pytest.mark.parametrize("kernel, dtype", sm90_params(WS_BUILDS))
def test_warp_specialized_prefill_builds_for_sm90(sm90_report, kernel, dtype):
    """The Gluon prefill (no interpreter can run it; tests/gpu/test_gpu_attention.py checks its
    numbers on a GPU) builds for sm_90 with triton's current Gluon API: no spills, no serialized
    wgmmas, and the producer's registers handed to the two consumer warpgroups."""
    assert sm90_report[f"{kernel}/{dtype}"] == "ok"
    assert sm90_report[f"{kernel}-ptxas/{dtype}"] == "ok"
    assert sm90_report[f"{kernel}-regs/{dtype}"] == "ok"


@pytest.mark.parametrize("dtype", sm90_dtypes("prefill"))
def test_default_prefill_wgmmas_are_not_serialized(sm90_report, dtype):
    assert sm90_report[f"prefill-ptxas/{dtype}"] == "ok"


# ---- plain-python parts (no triton) ---------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3, 8, 64])
@pytest.mark.parametrize("max_seq", [37, 1024, 8192, 131072])
def test_decode_num_splits(batch, max_seq):
    from dsc.kernels.attention import DECODE_CONFIGS, MAX_SPLITS, decode_num_splits

    cfg = DECODE_CONFIGS[("sm_90", 128)]
    splits = decode_num_splits(batch, 8, max_seq, cfg, n_sm=132)
    assert 1 <= splits <= MAX_SPLITS
    assert splits * cfg["MIN_SPLIT"] < max_seq + cfg["MIN_SPLIT"]  # a full cache uses every split
    if batch * 8 >= cfg["PROGRAMS_PER_SM"] * 132:
        assert splits == 1  # enough (sequence, kv head) programs already: no split partials


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "default"])
@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 128, 256])
def test_attention_config_has_an_entry_for_every_head_dim(head_dim, arch):
    from dsc.kernels.attention import attention_config

    assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} <= attention_config("prefill", head_dim, arch).keys()
    assert {"BLOCK_N", "num_warps", "num_stages", "PROGRAMS_PER_SM", "MIN_SPLIT"} <= attention_config(
        "decode", head_dim, arch
    ).keys()


@pytest.mark.parametrize("seq, batch, splits", [(1, None, 32), (1, 64, 1), (7, None, None)])
def test_planner_reports_kernels_and_launches(seq, batch, splits):
    """Decode is one launch whatever the splits (the last split combines the partials)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import dsc.kernels  # noqa: F401  (registers the planners)
    from dsc.kernels.launch import PLANNERS

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        B = batch or mode.shape_env.create_unbacked_symint()  # symbolic, as in a traced program
        q, k = torch.empty(B, 32, seq, 128), torch.empty(B, 8, seq, 128)
        cache, pos = torch.empty(64, 8, 8192, 128), torch.empty(B, dtype=torch.long)
        plan = PLANNERS["dsc.attention.default"](q, k, k, cache, cache, pos, 0.1, arch="sm_90")
    assert plan["launches"] == 1
    assert plan["name"] == ("triton.attention_decode" if seq == 1 else "triton.attention_prefill")
    assert plan["config"].get("splits") == splits
    assert "num_warps" in plan["config"]
    with mode:
        cos = torch.empty(B, seq, 128)
        fused = PLANNERS["dsc.rotary_attention.default"](q, k, k, cos, cos, cache, cache, pos, 0.1, arch="sm_90")
    # decode: the rotation runs in the attention kernel (one launch); prefill: the rotary kernel first
    assert fused["launches"] == (1 if seq == 1 else 2)
    assert fused["name"] == (
        "triton.rotary_attention_decode" if seq == 1 else "triton.rotary + triton.attention_prefill"
    )
    assert fused["config"].items() >= plan["config"].items()


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_fp32_configs_fit_shared_memory(sm90_report, kind):
    """An fp32 model at head_dim 128 (sm_90's 16-bit prefill row would stage 256 KiB: an H200 ran
    out of shared memory at load) gets a config whose sm_90 build fits a block's 227 KiB; the
    16-bit rows are untouched."""
    from dsc.kernels.attention import DECODE_CONFIGS, PREFILL_CONFIGS, SMEM_BUDGET, attention_config, staged_bytes

    assert sm90_report[f"{kind}-fp32-d128-smem"] == "ok"
    table = PREFILL_CONFIGS if kind == "prefill" else DECODE_CONFIGS
    for arch, head_dim in table:
        assert attention_config(kind, head_dim, arch) == attention_config(kind, head_dim, arch, itemsize=2)
        assert staged_bytes(kind, attention_config(kind, head_dim, arch, itemsize=4), head_dim, 4) <= SMEM_BUDGET
    if kind == "prefill":
        assert attention_config(kind, 128, "sm_90", itemsize=2)["BLOCK_M"] == 128  # the measured row
        assert {
            k: attention_config(kind, 128, "sm_90", itemsize=4)[k] for k in ("BLOCK_M", "BLOCK_N", "num_stages")
        } == {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}


def test_variant_keys_are_on_only_where_measured():
    """The prefill variant runs only where a config asks for it: TMA at sm_90 / head_dim 128 (the
    row an H200 run checked and found faster), DEFER_PV nowhere (slower there)."""
    from dsc.kernels.attention import PREFILL_CONFIGS, attention_config

    for arch, head_dim in PREFILL_CONFIGS:
        cfg = attention_config("prefill", head_dim, arch)
        assert bool(cfg.get("TMA")) == ((arch, head_dim) == ("sm_90", 128)) and not cfg.get("DEFER_PV"), (
            arch,
            head_dim,
            cfg,
        )


def test_tma_descriptors_need_16_byte_alignment():
    """TMA addresses 16-byte aligned bases and strides only; otherwise the wrapper loads through
    pointers (the default code), whatever the config asks."""
    pytest.importorskip("triton")
    from dsc.kernels.attention import _kv_descriptors

    k, cache = torch.randn(2, 2, 5, 16, dtype=torch.float16), torch.randn(3, 2, 37, 16, dtype=torch.float16)
    descs = _kv_descriptors(k, k, cache, cache, 16, 16)
    assert descs is not None and descs[2].shape == [3, 2, 37, 16] and descs[0].block_shape == [1, 1, 16, 16]
    odd = torch.randn(2, 2, 5, 20, dtype=torch.float16)  # rows of 40 bytes
    assert _kv_descriptors(odd, odd, cache, cache, 16, 32) is None
    shifted = torch.randn(2 * 2 * 5 * 16 + 1, dtype=torch.float16)[1:].view(2, 2, 5, 16)  # base 2 bytes off
    assert _kv_descriptors(shifted, k, cache, cache, 16, 16) is None


def test_reference_drops_writes_past_the_cache():
    from dsc.kernels.attention import write_kv_cache_reference

    k = torch.arange(1.0, 7.0).reshape(2, 1, 3, 1)  # [B=2, Hkv=1, S=3, D=1]
    k_cache = torch.zeros(3, 1, 5, 1)
    v_cache = torch.zeros(3, 1, 5, 1)
    write_kv_cache_reference(k, -k, k_cache, v_cache, torch.tensor([1, 3]))
    assert k_cache[:, 0, :, 0].tolist() == [[0, 1, 2, 3, 0], [0, 0, 0, 4, 5], [0, 0, 0, 0, 0]]
    assert torch.equal(v_cache, -k_cache)


def test_cpu_op_is_the_reference():
    import dsc.kernels  # noqa: F401
    from dsc.kernels.attention import attention_reference

    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, 4, 3, 16, generator=g),
        torch.randn(2, 2, 3, 16, generator=g),
        torch.randn(2, 2, 3, 16, generator=g),
    )
    caches = [torch.zeros(2, 2, 9, 16) for _ in range(4)]
    pos = torch.tensor([0, 4])
    got = torch.ops.dsc.attention(q, k, v, caches[0], caches[1], pos, 0.25)
    want = attention_reference(q, k, v, caches[2], caches[3], pos, 0.25)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rotary_attention_is_rotary_then_attention(dtype):
    """The fused op's CPU implementation gives the unfused pair's bits: output and cache."""
    import dsc.kernels  # noqa: F401

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 1, 16, generator=g).to(dtype) for h in (6, 2, 2))
    cos, sin = (torch.randn(2, 1, 16, generator=g).to(dtype) for _ in range(2))
    caches = [torch.zeros(3, 2, 9, 16, dtype=dtype) for _ in range(4)]
    pos = torch.tensor([0, 8])
    got = torch.ops.dsc.rotary_attention(q, k, v, cos, sin, caches[0], caches[1], pos, 0.25, 3)
    rq, rk = torch.ops.dsc.rotary(q, k, cos, sin)
    want = torch.ops.dsc.attention(rq, rk, v, caches[2], caches[3], pos, 0.25, 3)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    # rot_pos: cos and sin are tables [P, D] whose rows rot_pos are the pair's cos and sin
    tables = [torch.randn(12, 16, generator=g).to(dtype) for _ in range(2)]
    rot_pos = torch.tensor([[7], [2]])
    tables[0][rot_pos[:, 0]], tables[1][rot_pos[:, 0]] = cos[:, 0], sin[:, 0]
    caches += [torch.zeros(3, 2, 9, 16, dtype=dtype) for _ in range(2)]
    got = torch.ops.dsc.rotary_attention(q, k, v, *tables, caches[4], caches[5], pos, 0.25, 3, rot_pos)
    assert torch.equal(got, want) and torch.equal(caches[4], caches[2]) and torch.equal(caches[5], caches[3])


def test_decode_preload_comes_from_the_row():
    """PRE_N and num_warps are the config's (PRE_N 0 where the row has none)."""
    from dsc.kernels.attention import DECODE_CONFIGS, decode_preload

    assert decode_preload(DECODE_CONFIGS[("sm_90", 128)]) == {"PRE_N": 128, "num_warps": 8}
    assert decode_preload({"num_warps": 4}) == {"PRE_N": 0, "num_warps": 4}


if __name__ == "__main__":
    {"interpret": _worker, "compile-sm90": _compile_sm90}[sys.argv[1]]()


def _meta_attention(dtype=torch.bfloat16, H=32, Hkv=8, D=128, S=2048, Smax=4096):
    q = torch.empty(1, H, S, D, dtype=dtype, device="meta")
    k, v = (torch.empty(1, Hkv, S, D, dtype=dtype, device="meta") for _ in range(2))
    kc, vc = (torch.empty(1, Hkv, Smax, D, dtype=dtype, device="meta") for _ in range(2))
    return q, k, v, kc, vc, torch.zeros(1, dtype=torch.int64, device="meta")


@pytest.mark.parametrize(
    "change, runs_ws",
    [
        ({}, True),
        (dict(dtype=torch.float16), True),
        (dict(H=8, Hkv=8), True),
        (dict(H=64, Hkv=8), True),
        (dict(dtype=torch.float32), False),
        (dict(H=24, Hkv=8), False),
        (dict(H=32, Hkv=2), False),
        (dict(D=80), False),
        (dict(D=256), False),
    ],
)
def test_which_prefills_the_warp_specialized_kernel_takes(change, runs_ws):
    """16-bit tensors of one dtype, head_dim 64 or 128, 1, 2, 4 or 8 query heads per kv head,
    no sliding window: the Gluon kernel's (a warpgroup's 64 rows are 64 / G tokens of each head,
    a multiple of 8); anything else runs the Triton kernel."""
    from dsc.kernels.attention_sm90 import prefill_ws_supported

    q, k, v, kc, vc, _ = _meta_attention(**change)
    assert prefill_ws_supported(q, k, v, kc, vc, 0) is runs_ws
    assert prefill_ws_supported(q, k, v, kc, vc, 4096) is False  # a sliding window
    if runs_ws:  # a cache of another dtype
        assert prefill_ws_supported(q, k, v, kc.to(torch.float32), vc.to(torch.float32), 0) is False


def test_the_plan_names_the_kernel_a_prefill_runs():
    """plan.json / dsc inspect: on sm_90 a bf16 Llama-8B prefill runs the warp-specialized kernel
    (its own tile), with a window or in fp32 the Triton kernel (the table's row without WS); off
    sm_90 the Triton kernel."""
    from dsc.kernels.attention import _plan_attention
    from dsc.kernels.attention_sm90 import WS_CONFIGS

    q, k, v, kc, vc, pos = _meta_attention()
    plan = _plan_attention(q, k, v, kc, vc, pos, 0.1, arch="sm_90")
    assert plan == {"name": "gluon.attention_prefill_ws", "config": {**WS_CONFIGS[128], "group": 4}, "launches": 1}
    windowed = _plan_attention(q, k, v, kc, vc, pos, 0.1, 4096, arch="sm_90")
    assert windowed["name"] == "triton.attention_prefill" and "WS" not in windowed["config"]
    assert windowed["config"]["window"] == 4096 and windowed["config"]["TMA"] is True
    fp32 = _plan_attention(*_meta_attention(dtype=torch.float32), 0.1, arch="sm_90")
    assert fp32["name"] == "triton.attention_prefill"
    assert _plan_attention(q, k, v, kc, vc, pos, 0.1, arch="default")["name"] == "triton.attention_prefill"
