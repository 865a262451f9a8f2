"""dsc::paged_attention (kernels/paged_attention.py): the plain-torch reference against the static
attention reference on the same tokens, and the Triton kernels against the reference.

Steps come from tests/paged_steps.py (shuffled blocks and rows, padding sequences and rows,
NaN in every pool slot a step must not read); the output is NaN before the call too, so a
kernel that reads a poisoned slot or leaves a row shows NaN.

The kernels run in the Triton interpreter in a child process (TRITON_INTERPRET=1 must be set
before triton is first imported: tests/kernel_child.py), fp32 and fp16 (the interpreter's bf16
tl.dot is wrong); a second child builds them for sm_90 in bf16 (no GPU needed), where the
interpreter cannot look: PDL's wait before any memory access, no register spills.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from kernel_child import child_fixtures
from paged_steps import ARGS, Case, args_of, build, decode_case, expected, pool_problems

# -- the reference against the static attention's ------------------------------------------------
REFERENCE_CASES = {
    "gqa-mixed": Case(2, 3, 16, 16, ((0, 7), (21, 1), (5, 20), (40, 1)), pad_rows=3),
    "gqa-padding-seqs-window": Case(2, 2, 16, 16, ((17, 5), (0, 0), (3, 1), (30, 12)), pad_rows=2, window=9),
    "mqa-bs32-d24": Case(1, 8, 24, 32, ((70, 3), (0, 33)), window=40),
    "mha-decode": Case(3, 1, 12, 16, ((9, 1), (0, 0), (33, 1), (2, 1)), pad_rows=1),
}


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_matches_static_attention(name):
    """Each sequence's rows equal dsc.attention's reference over a static cache holding the same
    tokens (cache_pos = its cached tokens), and its pool rows equal that cache after the write;
    padding rows are zeros and padding slots are not written."""
    from dsc.kernels.attention import attention_reference
    from dsc.kernels.paged_attention import paged_attention_reference

    case = REFERENCE_CASES[name]
    step = build(case, torch.float32, seed=3)
    step["k_pool"], step["v_pool"] = step["k_pool"].nan_to_num(), step["v_pool"].nan_to_num()
    before = {name: step[name].clone() for name in ("k_pool", "v_pool")}
    out = paged_attention_reference(*args_of(step))
    bt, BS = step["block_tables"], case.BS
    as_rows = lambda pool, blocks: pool[blocks].transpose(0, 1).reshape(case.Hkv, -1, case.D)  # noqa: E731
    covered = torch.zeros(out.shape[1], dtype=torch.bool)
    for i, (c, n) in enumerate(case.seqs):
        if not n:
            continue
        a = int(step["query_start"][i])
        covered[a : a + n] = True
        blocks = bt[i, : -(-(c + n) // BS)].long()
        caches = [as_rows(before[name], blocks)[None, :, : c + n + 5].clone() for name in ("k_pool", "v_pool")]
        for cache in caches:
            cache[:, :, c:] = 0.0  # nothing at or past the new tokens yet
        rows = slice(a, a + n)
        want = attention_reference(
            step["q"][:, :, rows],
            step["k"][:, :, rows],
            step["v"][:, :, rows],
            *caches,
            torch.tensor([c]),
            step["scale"],
            case.window,
        )
        torch.testing.assert_close(out[:, rows], want, rtol=1e-5, atol=1e-5)
        for name, cache in zip(("k_pool", "v_pool"), caches):
            assert torch.equal(as_rows(step[name], blocks)[:, : c + n], cache[0, :, : c + n])
    assert torch.equal(out[:, ~covered], torch.zeros_like(out[:, ~covered]))
    untouched = torch.ones(before["k_pool"].shape[0] * BS, dtype=torch.bool)
    untouched[step["slot_mapping"][step["slot_mapping"] >= 0].long()] = False
    flat = lambda pool: pool.transpose(1, 2).reshape(-1, case.Hkv, case.D)  # noqa: E731  [slots, Hkv, D]
    for name in ("k_pool", "v_pool"):
        assert torch.equal(flat(step[name])[untouched], flat(before[name])[untouched])


def test_ragged_reference_is_paged_without_a_cache():
    """dsc.ragged_attention (what tracing records) is paged attention with every cache_lens 0."""
    from dsc.kernels.paged_attention import paged_attention_reference, ragged_attention_reference

    step = build(Case(2, 2, 16, 16, ((0, 9), (0, 0), (0, 4)), pad_rows=2, window=5), torch.float32, seed=4)
    step["k_pool"], step["v_pool"] = step["k_pool"].nan_to_num(), step["v_pool"].nan_to_num()
    ragged = ragged_attention_reference(*[step[n] for n in ARGS if n not in ("k_pool", "v_pool")])
    torch.testing.assert_close(ragged, paged_attention_reference(*args_of(step)), rtol=1e-6, atol=1e-6)


def test_cpu_op_is_the_reference():
    import dsc.kernels  # noqa: F401
    from dsc.kernels.paged_attention import paged_attention_reference

    step = build(REFERENCE_CASES["gqa-mixed"], torch.float32, seed=5)
    step["k_pool"], step["v_pool"] = step["k_pool"].nan_to_num(), step["v_pool"].nan_to_num()
    mine = {**step, "k_pool": step["k_pool"].clone(), "v_pool": step["v_pool"].clone()}
    got = torch.ops.dsc.paged_attention(*args_of(mine))
    want = paged_attention_reference(*args_of(step))
    assert torch.equal(got, want) and torch.equal(mine["k_pool"], step["k_pool"])


# -- the planner ------------------------------------------------------------------------------------
def _step_shapes(T, N, H=32, Hkv=8, D=128, BS=16, max_blocks=128, device="meta"):
    """A bf16 step's arguments as tensors without data (meta, or fake ones with symbolic T and N)."""
    empty = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
    i32 = torch.int32
    return (
        empty(1, H, T, D),
        empty(1, Hkv, T, D),
        empty(1, Hkv, T, D),
        empty(4096, Hkv, BS, D),
        empty(4096, Hkv, BS, D),
        empty(T, dtype=i32),
        empty(N, dtype=i32),
        empty(N, dtype=i32),
        empty(N, dtype=i32),
        empty(N, max_blocks, dtype=i32),
        0.1,
    )


def test_planner_names_the_kernel_and_counts_launches():
    """T == N: the decode kernel (one launch, splits from N and max_blocks * block_size); other
    T: the output's memset, the varlen kernel and the decode kernel (three); symbolic T and N
    (the traced ragged program): the same, splits at N = 1."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dsc.kernels.launch import PLANNERS

    plan = PLANNERS["dsc.paged_attention.default"]
    dec = plan(*_step_shapes(64, 64), arch="sm_90")
    assert dec["name"] == "triton.paged_attention_decode" and dec["launches"] == 1
    assert dec["config"]["splits"] == 1 and dec["config"]["group"] == 4 and dec["config"]["block_size"] == 16
    one = plan(*_step_shapes(1, 1, max_blocks=256), arch="sm_90")["config"]
    assert one["splits"] == 16  # 4096 keys / MIN_SPLIT 256 (2 programs per SM would allow 33)
    mixed = plan(*_step_shapes(512, 64), 4096, arch="sm_90")
    assert mixed["name"] == "triton.paged_attention_mixed" and mixed["launches"] == 3
    assert mixed["config"]["decode"] == {**dec["config"], "window": 4096}
    varlen = mixed["config"]["varlen"]
    assert varlen["window"] == 4096 and varlen["BLOCK_M"] == 128 and not {"TMA", "WS", "PRE_N"} & set(varlen)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        T, N = mode.shape_env.create_unbacked_symint(), mode.shape_env.create_unbacked_symint()
        sym = plan(*_step_shapes(T, N, device="cpu"), arch="sm_90")
    assert sym["name"] == "triton.paged_attention" and sym["launches"] == 3
    assert sym["config"]["decode"]["splits"] == 8  # 2048 keys / MIN_SPLIT 256
    assert sym["config"]["varlen"] == {key: value for key, value in varlen.items() if key != "window"}


# -- the Triton kernels in the interpreter ----------------------------------------------------------
SMALL_PREFILL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
SMALL_DECODE = dict(BLOCK_N=16, num_warps=4, num_stages=1, MIN_SPLIT=16, PROGRAMS_PER_SM=2)


MANY = tuple((int(c), int(n)) for c, n in zip(torch.arange(40) * 7 % 23, torch.arange(40) * 5 % 4))
KERNEL_CASES = {
    # mixed steps: prefill chunks (fresh and on a cached prefix) with decode tokens (the decode
    # kernel's, here with splits), padding rows
    "mixed-gqa3": Case(
        2,
        3,
        16,
        16,
        ((0, 7), (21, 1), (5, 20), (40, 1)),
        pad_rows=3,
        config=SMALL_PREFILL,
        decode_config=SMALL_DECODE,
        num_splits=3,
    ),
    "mixed-padding-seqs": Case(
        2, 2, 16, 16, ((17, 5), (0, 0), (3, 1), (0, 0), (30, 12)), pad_rows=2, config=SMALL_PREFILL
    ),
    # G > BLOCK_M: a token's rows straddle row tiles; odd head_dim; block size 32
    "mixed-mqa-straddle-d24-bs32": Case(1, 24, 24, 32, ((3, 5), (0, 9), (40, 1)), config=SMALL_PREFILL),
    "mixed-mha-d12": Case(3, 1, 12, 16, ((33, 17), (2, 3)), pad_rows=1, config=SMALL_PREFILL),
    "mixed-window": Case(
        2,
        2,
        16,
        16,
        ((30, 12), (0, 20), (50, 1), (6, 3)),
        window=7,
        config=SMALL_PREFILL,
        decode_config=SMALL_DECODE,
        num_splits=2,
    ),
    "mixed-window-long": Case(2, 2, 16, 32, ((70, 9), (10, 30)), window=40, config=SMALL_PREFILL),
    # 40 sequences, many without tokens or with one: the tile lookup's scan runs over several chunks
    "mixed-many-seqs": Case(1, 2, 16, 16, MANY, pad_rows=5, config=dict(SMALL_PREFILL, BLOCK_S=16)),
    "mixed-table-config-d64": Case(2, 4, 64, 16, ((0, 37), (19, 2), (64, 1))),
    "mixed-pool-fp32": Case(2, 2, 16, 16, ((11, 6), (0, 3)), config=SMALL_PREFILL, pool_dtype="float32"),
    # the varlen kernel for every sequence, single tokens included
    "mixed-all-varlen": Case(
        2, 3, 16, 16, ((0, 7), (21, 1), (5, 20), (40, 1)), pad_rows=3, config=SMALL_PREFILL, path="varlen"
    ),
    "mixed-many-seqs-all-varlen": Case(
        1, 2, 16, 16, MANY, pad_rows=5, config=dict(SMALL_PREFILL, BLOCK_S=16), path="varlen"
    ),
    # decode steps (T == N): one split, splits, a window, more splits than keys, padding
    # sequences anywhere in the batch (their query_start 0: a real row they must not touch)
    "decode-table-config": decode_case(((0, 1), (20, 1), (36, 1)), Hkv=2, G=3, D=16, BS=16),
    "decode-splits": decode_case(
        ((0, 1), (20, 1), (47, 1), (0, 0)), Hkv=2, G=3, D=16, BS=16, decode_config=SMALL_DECODE, num_splits=3
    ),
    "decode-window": decode_case(
        ((3, 1), (30, 1), (60, 1)), Hkv=2, G=3, D=16, BS=16, decode_config=SMALL_DECODE, num_splits=3, window=20
    ),
    "decode-many-splits": decode_case(
        ((36, 1), (69, 1)), Hkv=2, G=2, D=16, BS=16, decode_config=SMALL_DECODE, num_splits=7
    ),
    "decode-padding": decode_case(
        ((5, 1), (0, 0), (44, 1), (12, 1), (0, 0), (1, 1)),
        Hkv=2,
        G=2,
        D=16,
        BS=16,
        decode_config=SMALL_DECODE,
        num_splits=2,
    ),
    "decode-mqa-d24-bs32": decode_case(
        ((70, 1), (0, 0), (31, 1)), Hkv=1, G=8, D=24, BS=32, decode_config=SMALL_DECODE, num_splits=2
    ),
    "decode-many-seqs": decode_case(
        tuple((c, 0 if i in (3, 17, 18) else 1) for i, (c, _) in enumerate(MANY[:20])),
        Hkv=1,
        G=2,
        D=16,
        BS=16,
        decode_config=dict(SMALL_DECODE, BLOCK_S=16),
        num_splits=2,
    ),
    # a decode step on the mixed path and on the varlen kernel alone (the runtime may send one
    # in a mixed bucket)
    "decode-step-as-mixed": decode_case(
        ((5, 1), (0, 0), (44, 1), (12, 1)),
        Hkv=2,
        G=2,
        D=16,
        BS=16,
        decode_config=SMALL_DECODE,
        num_splits=2,
        path="mixed",
        window=9,
    ),
    "decode-step-as-varlen": decode_case(
        ((5, 1), (0, 0), (44, 1), (12, 1)), Hkv=2, G=2, D=16, BS=16, config=SMALL_PREFILL, path="varlen", window=9
    ),
}
DTYPES = ("float32", "float16")
TOL = {"float32": 2e-5, "float16": 2e-3}  # max |kernel - fp32 reference| / max(1, |reference|)


def run_case(case: Case, dtype: torch.dtype) -> str:
    """One case in the interpreter: "ok" or what is wrong."""
    from dsc.kernels.paged_attention import paged_attention_triton

    step = build(case, dtype)
    ref, want_k, want_v = expected(step)
    out = torch.full_like(ref, float("nan"), dtype=dtype)
    paged_attention_triton(
        *args_of(step),
        out=out,
        path=case.path,
        config=case.config,
        decode_config=case.decode_config,
        num_splits=case.num_splits,
    )
    problems = pool_problems(step, want_k, want_v)
    if out.isnan().any():
        problems.append(f"out has NaN at [0, t, h, d] {out.isnan().nonzero()[:3].tolist()}")
    err = ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
    if not err <= TOL[str(dtype).removeprefix("torch.")]:
        problems.append(f"out: relative max error {err:.3g}")
    return "; ".join(problems) or "ok"


def decode_contract_broken() -> str:
    """A decode step (T == N) in which a sequence brings two tokens: its first row is NaN."""
    from dsc.kernels.paged_attention import paged_attention_triton

    step = build(Case(1, 2, 16, 16, ((4, 2), (9, 0))), torch.float32)
    out = paged_attention_triton(*args_of(step), decode_config=SMALL_DECODE)
    start = int(step["query_start"][0])
    return "ok" if bool(out[0, start].isnan().all()) else f"row {start}: {out[0, start, :, :2].tolist()}"


def run_interpreted(path: str) -> None:
    torch.set_num_threads(1)
    report = {}
    for name, case in KERNEL_CASES.items():
        for dtype in DTYPES:
            try:
                report[f"{name}/{dtype}"] = run_case(case, getattr(torch, dtype))
            except Exception as e:  # reported per case by the parent, not swallowed
                report[f"{name}/{dtype}"] = f"raised {type(e).__name__}: {e}"
    report["decode-contract-broken"] = decode_contract_broken()
    from dsc.kernels import launch

    counters = list(launch.COUNTERS.values())
    report["split-counters-reset"] = (
        "ok"
        if counters and all(bool((c == 0).all()) for c in counters)
        else f"counters {[c.nonzero().flatten().tolist()[:8] for c in counters]}"
    )
    Path(path).write_text(json.dumps(report, indent=1))


# -- ahead-of-time for sm_90 (no GPU): the table's configs at Llama-8B's heads, bf16 ----------------
def run_aot(path: str) -> None:
    from kernel_child import pdl_check, spill_bytes

    from dsc.kernels import paged_attention as P
    from dsc.kernels.launch import compile_for_arch

    P._kernels()
    ptrs = {
        **{n: "*bf16" for n in ("Q", "K", "V", "KP", "VP", "OUT")},
        **{n: "*i32" for n in ("SLOTS", "QSTART", "QLEN", "CLEN", "BT")},
        "qk_scale": "fp32",
        "cap": "fp32",
    }
    strides = (
        "sq_h",
        "sq_t",
        "sk_h",
        "sk_t",
        "sv_h",
        "sv_t",
        "skp_b",
        "skp_h",
        "skp_s",
        "svp_b",
        "svp_h",
        "svp_s",
        "sbt",
        "so_t",
        "so_h",
    )
    aligned = tuple(n for n in (*ptrs, *strides) if n not in ("qk_scale", "cap", "sbt"))
    report = {}
    dec = P.paged_attention_config("decode", 128, "sm_90")
    pre = P.paged_attention_config("prefill", 128, "sm_90")
    for window in (False, True):
        for pdl in (not window,):  # the production build (PDL: on at sm_90), and one without PDL
            types = {
                **ptrs,
                "PART_O": "*fp32",
                "PART_LSE": "*fp32",
                "LOCK": "*i32",
                **{
                    n: "i32"
                    for n in (
                        *strides,
                        "sp_b",
                        "sp_h",
                        "sp_s",
                        "sl_b",
                        "sl_h",
                        "T",
                        "N",
                        "Hkv",
                        "split_floor",
                        "window",
                    )
                },
            }
            k = compile_for_arch(
                P._paged_decode_kernel,
                types,
                dict(
                    G=4,
                    HEAD_DIM=128,
                    BLOCK_D=128,
                    BLOCK_H=16,
                    BLOCK_N=dec["BLOCK_N"],
                    BLOCK_S=64,
                    BS=16,
                    SPLIT=True,
                    WINDOWED=window,
                    MIXED=window,
                    PDL=pdl,
                    SLOPES=None,
                ),
                num_warps=dec["num_warps"],
                num_stages=dec["num_stages"],
                aligned=aligned,
            )
            report[f"decode{'-window' * window}{'-pdl' * pdl}"] = {"pdl": pdl_check(k, pdl), "spills": spill_bytes(k)}
        types = {**ptrs, **{n: "i32" for n in (*strides, "N", "window")}}
        k = compile_for_arch(
            P._paged_prefill_kernel,
            types,
            dict(
                G=4,
                HEAD_DIM=128,
                BLOCK_D=128,
                BLOCK_M=pre["BLOCK_M"],
                BLOCK_N=pre["BLOCK_N"],
                BLOCK_S=64,
                BS=16,
                WINDOWED=window,
                SINGLES=window,
                SLOPES=None,
            ),
            num_warps=pre["num_warps"],
            num_stages=pre["num_stages"],
            aligned=aligned,
        )
        report[f"varlen{'-window' * window}"] = {"pdl": "ok", "spills": spill_bytes(k)}
    Path(path).write_text(json.dumps(report, indent=1))


interpreted, compiled = child_fixtures(__file__, "paged")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_reference(interpreted, case, dtype):
    assert interpreted[f"{case}/{dtype}"] == "ok"


def test_decode_step_with_two_tokens_in_a_sequence_is_loud(interpreted):
    assert interpreted["decode-contract-broken"] == "ok"


def test_split_counters_are_reset(interpreted):
    assert interpreted["split-counters-reset"] == "ok"


@pytest.mark.parametrize("kernel", ["decode-pdl", "decode-window", "varlen", "varlen-window"])
def test_kernel_builds_for_sm90(compiled, kernel):
    """bf16 at the sm_90 table's configs: the decode kernel with PDL waits before any memory
    access (and has no griddepcontrol without it); no build spills registers."""
    assert compiled[kernel] == {"pdl": "ok", "spills": 0}


if __name__ == "__main__":
    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])
