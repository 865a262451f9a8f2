"""The fused all-reduce + add + RMSNorm kernels (kernels/collectives.py) in the Triton
interpreter, one rank of several in one process: the other ranks' side is set up by hand as it
would be once they have run (their rows delivered into this rank's push buffer), then this
rank's kernel runs. Checked: the sum, add and norm against dsc's reference; what the kernel
leaves behind for the peers (its row in their push buffers with -0.0 sent as +0.0); and that it
resets its own state (push buffer back to the marker everywhere). The cross-GPU behaviour
(ordering, skew, buffer reuse) is what tests/gpu/test_gpu_collectives.py checks on GPUs.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from kernel_child import child_fixtures

from dsc.kernels import collectives as C
from dsc.kernels import int8
from dsc.kernels.embedding import vocab_embedding_reference
from dsc.kernels.norm import add_rmsnorm_reference, rmsnorm_reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}  # the interpreter rounds bf16 differently
CASES = {"w2-r1": (2, 1), "w4-r0": (4, 0), "w4-r2": (4, 2)}  # (world, this rank)
ROWS, N, CAP, EPS = 3, 40, 4, 1e-5  # rows of this call, row width (not a power of 2), max rows
VOCAB = 7  # a rank's rows of the embedding table (EMBED)


def _inputs(world: int, rank: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(world * 10 + rank)
    xs = [torch.randn(ROWS, N, generator=g).to(dtype) for _ in range(world)]
    xs[rank][0, :5] = -0.0  # sent as +0.0: -0.0 is the marker
    res = torch.randn(ROWS, N, generator=g).to(dtype)
    w = torch.randn(N, generator=g).to(dtype)
    total = sum(x.float() for x in xs)  # fp32, rank order, rounded once: what the kernels do
    want_s, want_y = add_rmsnorm_reference(total.to(dtype), res, w, EPS)
    return xs, res, w, want_s, want_y


def _push_buffers(world: int, rank: int, dtype: torch.dtype, slot: int, peers: list[torch.Tensor]):
    """Every rank's push buffer of `slot` (the marker everywhere) with the peers' rows `peers[q]`
    already delivered into this rank's, as once their kernels have run; and the `_Symmetric`
    stand-in pointing at them."""
    numel = CAP * N
    bufs = [torch.empty(world * numel, dtype=dtype) for _ in range(world)]
    for b in bufs:
        b.view(C._BITS[dtype]).fill_(C._MARK[dtype])
    for q in range(world):
        if q != rank:
            bufs[rank][q * numel : q * numel + peers[q].numel()] = peers[q].flatten()
    ptrs = torch.zeros(3, world, dtype=torch.int64)
    ptrs[slot] = torch.tensor([b.data_ptr() for b in bufs])
    return bufs, types.SimpleNamespace(world=world, rank=rank, numel=numel, rows=CAP, dtype=dtype, push_ptrs=ptrs)


def _compare(got_s, got_y, want_s, want_y) -> dict:
    return {"sum_equal": torch.equal(got_s, want_s), "norm_err": float((got_y.float() - want_y.float()).abs().max())}


def _push(world: int, rank: int, dtype: torch.dtype) -> dict:
    numel, bits, mark = CAP * N, C._BITS[dtype], C._MARK[dtype]
    xs, res, w, want_s, want_y = _inputs(world, rank, dtype)
    slot = 1
    bufs, s = _push_buffers(world, rank, dtype, slot, xs)
    got_s, got_y = C._launch_fused(s, slot, xs[rank], res, w, EPS)
    sent = xs[rank].masked_fill(xs[rank] == 0, 0.0)  # -0.0 -> +0.0
    delivered = all(
        torch.equal(bufs[q][rank * numel : rank * numel + ROWS * N].view(bits), sent.flatten().view(bits))
        and int((bufs[q].view(bits) != mark).sum()) == ROWS * N
        for q in range(world)
        if q != rank
    )
    return {
        **_compare(got_s, got_y, want_s, want_y),
        "delivered": delivered,
        "negative_zero_sent_as_zero": bool((sent[0, :5].view(bits) == 0).all()),
        "own_buffer_reset": bool((bufs[rank].view(bits) == mark).all()),
    }


def _gemv_push(world: int, rank: int, dtype: torch.dtype, chunk: int, quant: str = "") -> dict:
    """The row-parallel linear + all-reduce + norm at one row: this rank's GEMV pushes x @ W.T
    into every rank's buffer, and its last program waits, sums and normalizes, `chunk` columns
    per pass (NORM_N).
    quant: the W8A16 GEMV push (`_launch_w8a16_push`) over W quantized per channel, "channel"
    (symmetric) or "channel-asym", or in groups of 8, "g8" (K = 40 then)."""
    numel, bits, mark, k = CAP * N, C._BITS[dtype], C._MARK[dtype], 40 if quant == "g8" else 37
    g = torch.Generator().manual_seed(100 + world * 10 + rank)
    xs = [torch.randn(1, N, generator=g).to(dtype) for _ in range(world)]  # every rank's linear output
    x_in = torch.randn(1, k, generator=g).to(dtype)
    wl = (torch.randn(N, k, generator=g) / k**0.5).to(dtype)
    wl[:3] = 0  # outputs 0..2: +0.0; output 3: -1e-8 in fp32, -0.0 once rounded to fp16 (sent as +0.0)
    wl[3] = 0
    wl[3, 0] = -1e-4
    x_in[0, 0] = 1e-4
    if quant:
        group = 8 if quant == "g8" else None
        qp = int8.quantize_weight(wl.float(), group, symmetric=quant != "channel-asym")
        qargs = (qp["qweight"], qp["scale"], qp["zero"] if quant == "channel-asym" else None, group or k)
        # this rank's, as the GEMV rounds it: the fp32 sum of x times the dequantized weight
        mine = int8.linear_w8a16_reference(x_in.float(), *qargs[:3], None, qargs[3]).to(dtype)
    else:
        mine = torch.nn.functional.linear(x_in.float(), wl.float()).to(dtype)  # this rank's, as the GEMV rounds it
    xs[rank] = mine
    res = torch.randn(1, N, generator=g).to(dtype)
    w = torch.randn(N, generator=g).to(dtype)
    total = sum(x.float() for x in xs)
    want_s, want_y = add_rmsnorm_reference(total.to(dtype), res, w, EPS)
    slot = 2
    bufs, s = _push_buffers(world, rank, dtype, slot, xs)
    cfg = {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 1}

    config, norm = {**cfg, "CHUNK": chunk}, (res, w, EPS)
    bufs_before = [b.clone() for b in bufs]
    if quant:
        got_s, got_y = C._launch_w8a16_push(s, slot, x_in, *qargs, {**config, "PREFETCH": quant == "g8"}, norm)
    else:
        got_s, got_y = C._launch_gemv_push(s, slot, x_in, wl, config, norm)
    delivered = [bufs[q][rank * numel : rank * numel + N].clone() for q in range(world)]
    # the pushes are the only change to the peers' buffers (their reset is their own kernel's)
    untouched = all(
        torch.equal(
            torch.cat([b[: rank * numel], b[rank * numel + N :]]).view(bits),
            torch.cat([o[: rank * numel], o[rank * numel + N :]]).view(bits),
        )
        for q, (b, o) in enumerate(zip(bufs, bufs_before))
        if q != rank
    )
    sent = mine.masked_fill(mine == 0, 0.0).flatten()
    return {
        "sum_err": float((got_s.float() - want_s.float()).abs().max()),
        "norm_err": float((got_y.float() - want_y.float()).abs().max()),
        "delivered_close": all(
            torch.allclose(
                d.float(),
                sent.float(),
                rtol=1e-2 if dtype != torch.float32 else 1e-5,
                atol=1e-3 if dtype != torch.float32 else 1e-6,
            )
            for q, d in enumerate(delivered)
            if q != rank
        ),
        "no_negative_zero_sent": all(
            not bool((d.view(bits) == mark).any()) for q, d in enumerate(delivered) if q != rank
        ),
        "own_buffer_reset": bool((bufs[rank].view(bits) == mark).all()),
        "peers_untouched": untouched,
    }


def _embed_push(world: int, rank: int, dtype: torch.dtype) -> dict:
    """The vocab-parallel embedding + all-reduce + RMSNorm (the push kernel with EMBED): this
    rank looks its tokens up in its VOCAB rows of the table (zeros for the others' ids), sends
    that, and sums with the peers' lookups, delivered as their kernels would send them."""
    numel, bits, mark = CAP * N, C._BITS[dtype], C._MARK[dtype]
    g = torch.Generator().manual_seed(200 + world * 10 + rank)
    full = torch.randn(world * VOCAB, N, generator=g).to(dtype)  # [world * VOCAB, N]: every rank's rows
    # [ROWS, 1]: a decode step's ids; this rank's, the next rank's (below start for the last rank), its last
    ids = torch.tensor([[rank * VOCAB + 2], [(rank + 1) % world * VOCAB], [rank * VOCAB + VOCAB - 1]])
    full[rank * VOCAB + 2, :5] = -0.0  # in this rank's rows: sent as +0.0
    w = torch.randn(N, generator=g).to(dtype)
    starts = [torch.tensor([q * VOCAB]) for q in range(world)]
    lookups = [vocab_embedding_reference(full[q * VOCAB : (q + 1) * VOCAB], ids, starts[q]) for q in range(world)]
    sent = [x.masked_fill(x == 0, 0.0) for x in lookups]  # [ROWS, 1, N] each, -0.0 -> +0.0
    want_h = sum(x.float() for x in lookups).to(dtype)  # fp32, rank order, rounded once: the all-reduce's
    want_y = rmsnorm_reference(want_h, w, EPS)
    slot = 0
    bufs, s = _push_buffers(world, rank, dtype, slot, sent)
    table = full[rank * VOCAB : (rank + 1) * VOCAB]
    got_h, got_y = C._launch_embedding_push(s, slot, table, ids, starts[rank], w, EPS)
    mine = sent[rank].flatten().view(bits)
    delivered = all(
        torch.equal(bufs[q][rank * numel : rank * numel + ROWS * N].view(bits), mine)
        and int((bufs[q].view(bits) != mark).sum()) == ROWS * N
        for q in range(world)
        if q != rank
    )
    return {
        "sum_equal": torch.equal(got_h, want_h) and got_h.shape == (ROWS, 1, N),
        "norm_err": float((got_y.float() - want_y.float()).abs().max()),
        "delivered": delivered,
        "negative_zero_sent_as_zero": bool(
            (lookups[rank].flatten().view(bits)[:5] == mark).all() and (mine.view(ROWS, N)[0, :5] == 0).all()
        ),
        "others_ids_zeros": bool((mine.view(ROWS, N)[1] == 0).all()) and bool(lookups[rank][0].any()),
        "own_buffer_reset": bool((bufs[rank].view(bits) == mark).all()),
    }


def _gather(world: int, rank: int, dtype: torch.dtype) -> dict:
    """The push all-gather (the vocab-parallel logits): this rank's block [ROWS, n] reaches its
    region of every rank's buffer (-0.0 sent as +0.0); with the peers' blocks delivered into
    this rank's, the output is the blocks in rank order, row by row; its buffer is reset. In
    blocks of 7 elements: several programs, the last one partial."""
    numel, bits, mark, n = CAP * N, C._BITS[dtype], C._MARK[dtype], 11
    g = torch.Generator().manual_seed(300 + world * 10 + rank)
    xs = [torch.randn(ROWS, n, generator=g).to(dtype) for _ in range(world)]
    xs[rank][1, :3] = -0.0
    sent = [x.masked_fill(x == 0, 0.0) for x in xs]
    slot = 2
    bufs, s = _push_buffers(world, rank, dtype, slot, sent)
    block = C.PUSH_GATHER
    C.PUSH_GATHER = dict(BLOCK=8, num_warps=1)
    try:
        got = C._launch_push_gather(s, slot, xs[rank])
    finally:
        C.PUSH_GATHER = block
    want = torch.cat(sent, dim=-1)
    mine = sent[rank].flatten().view(bits)
    delivered = all(
        torch.equal(bufs[q][rank * numel : rank * numel + ROWS * n].view(bits), mine)
        and int((bufs[q].view(bits) != mark).sum()) == ROWS * n
        for q in range(world)
        if q != rank
    )
    return {
        "gathered": torch.equal(got.view(bits), want.view(bits)) and got.shape == (ROWS, world * n),
        "delivered": delivered,
        "negative_zero_sent_as_zero": bool((mine.view(ROWS, n)[1, :3] == 0).all()),
        "own_buffer_reset": bool((bufs[rank].view(bits) == mark).all()),
    }


def _probe(dtype: torch.dtype) -> dict:
    """`_probe_fused` (the set-up's check of the push kernel, its embedding variant and the push
    all-gather) over a world of one: its launches give the known sums, and every buffer is back at the marker."""
    numel, bits, mark = CAP * N, C._BITS[dtype], C._MARK[dtype]
    bufs = [torch.empty(numel, dtype=dtype) for _ in range(3)]
    for b in bufs:
        b.view(bits).fill_(mark)
    ptrs = torch.tensor([[b.data_ptr()] for b in bufs], dtype=torch.int64)
    s = types.SimpleNamespace(world=1, rank=0, numel=numel, rows=CAP, dtype=dtype, push_ptrs=ptrs, buffers=bufs)
    errors = {}
    for compile_only in (True, False):
        try:
            C._probe_fused(s, compile_only=compile_only)
            errors[compile_only] = ""
        except Exception as e:  # noqa: BLE001  (reported by the test)
            errors[compile_only] = f"{type(e).__name__}: {e}"
    return {
        "compile_only": errors[True],
        "launched": errors[False],
        "reset": all(bool((b.view(bits) == mark).all()) for b in bufs),
    }


def run_interpreted(out: str) -> None:
    kinds = (
        ("push", _push),
        ("embed_push", _embed_push),
        ("gemv_push_norm", lambda w, r, dt: _gemv_push(w, r, dt, chunk=16)),  # 3 passes, the last partial
        ("gemv_push_norm1", lambda w, r, dt: _gemv_push(w, r, dt, chunk=64)),  # one pass
        # the W8A16 GEMV push (--int8) ending the all-reduce in 3 passes (asymmetric scales), in
        # one (groups of 8 columns, the next K-block prefetched)
        ("w8a16_push_norm", lambda w, r, dt: _gemv_push(w, r, dt, chunk=16, quant="channel-asym")),
        ("w8a16_push_norm1", lambda w, r, dt: _gemv_push(w, r, dt, chunk=64, quant="g8")),
        ("gather", _gather),
    )
    res = {
        f"{k}-{name}-{d}": fn(world, rank, dt)
        for k, fn in kinds
        for name, (world, rank) in CASES.items()
        for d, dt in DTYPES.items()
    }
    res.update({f"probe-{d}": _probe(dt) for d, dt in DTYPES.items()})
    Path(out).write_text(json.dumps(res, indent=1))


# -- ahead-of-time for sm_90 (no GPU): both kernels at tp 2 and 4, with and without PDL ------------
def run_aot(out: str) -> None:
    from kernel_child import pdl_check, spill_bytes

    from dsc.kernels.launch import compile_for_arch

    push = {
        **{n: "*bf16" for n in "X R W S Y".split()},
        "BUFS": "*i64",
        "stride_x": "i32",
        "stride_r": "i32",
        "eps": "fp32",
        "rank": "i32",
        "region": "i32",
        "IDS": "*i64",
        "START": "*i64",
        "vocab": "i32",
    }
    res = {}
    for world in (2, 4):
        for pdl in (False, True):
            common = {"N": 4096, "WORLD": world, "BLOCK_W": world, "BLOCK_N": 4096, "PDL": pdl}
            # (embed_push: the vocab-parallel embedding's lookup as the row sent, Llama-8B's hidden size;
            # the token ids and the table are as much another kernel's as the rows)
            for name, fn, arg_types, const in (
                ("push", C._ar_push_add_rmsnorm_kernel, push, {"MARK": -32768}),
                ("embed_push", C._ar_push_add_rmsnorm_kernel, push, {"MARK": -32768, "EMBED": True}),
            ):
                k = compile_for_arch(fn, arg_types, {**common, **const}, num_warps=8)
                # before the wait only the norm weight (read-only) may be read: the rows, the
                # residual and every buffer belong to kernels that may still run
                res[f"{name}-w{world}{'-pdl' if pdl else ''}"] = {
                    "ok": bool(k.asm.get("cubin")),
                    "pdl": pdl_check(k, pdl, frozenset({"load w"})),
                    **({"spills": spill_bytes(k)} if name == "embed_push" else {}),
                }
            # the GEMV that pushes its rows and ends the all-reduce: only its first weight tile
            # (EARLY_K: its first K-blocks) loads before the wait
            gemv = {
                "X": "*bf16",
                "W": "*bf16",
                "BUFS": "*i64",
                "N": "i32",
                "K": "i32",
                "rank": "i32",
                "region": "i32",
                "R": "*bf16",
                "NW": "*bf16",
                "S": "*bf16",
                "Y": "*bf16",
                "eps": "fp32",
            }
            const = {"EVEN": True, "X_ROW": False, "WORLD": world, "MARK": -32768, "PDL": pdl}
            # at the launch configs of Llama-8B's down_proj at
            # this tp (the GEMV push rows of [4096, 7168] and [4096, 3584], raised to 4 and 8
            # warps); at tp=4 also an 8192-wide row (a 70B-class hidden size): two passes
            push_row = {
                2: {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 2},
                4: {"BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 1},
            }[world]
            # (tp=2 also with 4 K-blocks, 4096 columns, loaded before the wait: kernels/tuning.json's
            # EARLY row at that shape)
            cases = (
                ("gemv_push_norm", 4096, {}),
                ("gemv_push_norm_chunked", 8192, {}),
                ("gemv_push_norm_early", 4096, {"EARLY_K": 4096}),
            )
            for name, n, extra in cases[: 1 + (world == 4)] + cases[2:] * (world == 2):
                cfg = {**C.gemv_push_norm_config(push_row, n, world), **extra}
                warps = cfg.pop("num_warps")
                k = compile_for_arch(
                    C._gemv_push_kernel,
                    gemv,
                    {**const, **cfg},
                    num_warps=warps,
                    aligned=("X", "W", "N", "K", "region", "R", "NW", "S", "Y"),
                )
                res[f"{name}-w{world}{'-pdl' if pdl else ''}"] = {
                    "ok": bool(k.asm.get("cubin")),
                    "pdl": pdl_check(k, pdl, frozenset({"load w"})),
                    "spills": spill_bytes(k),
                    "warps": warps,
                    "chunk": cfg["CHUNK"],
                }
            # the W8A16 GEMV push ending the all-reduce (--int8), at the configs of Llama-8B's
            # row-parallel o_proj and down_proj at this tp (the W8A16 GEMV's rows, or the shipped
            # w8a16_gemv_push rows over them at tp=4, raised for the norm)
            w8 = {**gemv, "W": "*i8", "WS": "*fp32", "WZ": "*i8", "G": "i32"}
            for n, k_ in {2: ((4096, 2048), (4096, 7168)), 4: ((4096, 1024), (4096, 3584))}[world]:
                row = C.w8a16_push_config(n, k_, 0, "sm_90")
                cfg = C.gemv_push_norm_config(row, n, world)
                const, opts = int8._split({"PREFETCH": False, "X_ROW": False, **cfg}, torch.device("cuda"))
                k = compile_for_arch(
                    C._w8a16_gemv_push_kernel,
                    w8,
                    {**const, "GROUP_K": 0, "HAS_ZERO": False, "WORLD": world, "MARK": -32768, "PDL": pdl},
                    num_warps=opts["num_warps"],
                    aligned=("X", "W", "WS", "N", "K", "region", "R", "NW", "S", "Y"),
                )
                res[f"w8a16_push_norm-N{n}K{k_}-w{world}{'-pdl' if pdl else ''}"] = {
                    "ok": bool(k.asm.get("cubin")),
                    "pdl": pdl_check(k, pdl, frozenset({"load w8"})),
                    "spills": spill_bytes(k),
                    "warps": opts["num_warps"],
                    "chunk": const["CHUNK"],
                    "fast_cvt": "prmt.b32" in k.asm.get("ptx", ""),
                }
            # the push all-gather at its launch config: nothing read or written before the wait
            k = compile_for_arch(
                C._push_gather_kernel,
                {
                    "X": "*bf16",
                    "Y": "*bf16",
                    "BUFS": "*i64",
                    "n": "i32",
                    "total": "i32",
                    "rank": "i32",
                    "region": "i32",
                },
                {"WORLD": world, "BLOCK_W": world, "BLOCK": C.PUSH_GATHER["BLOCK"], "MARK": -32768, "PDL": pdl},
                num_warps=C.PUSH_GATHER["num_warps"],
            )
            res[f"gather-w{world}{'-pdl' if pdl else ''}"] = {
                "ok": bool(k.asm.get("cubin")),
                "pdl": pdl_check(k, pdl),
                "spills": spill_bytes(k),
            }
    Path(out).write_text(json.dumps(res, indent=1))


interpreted, compiled = child_fixtures(__file__, "collectives")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_push_kernel_sums_delivers_and_resets(case, dtype, interpreted):
    r = interpreted[f"push-{case}-{dtype}"]
    assert r["sum_equal"] and r["norm_err"] < (1e-5 if dtype == "fp32" else 2e-3), r
    assert r["delivered"] and r["negative_zero_sent_as_zero"] and r["own_buffer_reset"], r


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_push_kernel_looks_up_sums_normalizes_and_resets(case, dtype, interpreted):
    """The vocab-parallel embedding + all-reduce + RMSNorm in one launch: this rank's lookup
    (zeros for another rank's id, -0.0 sent as +0.0) reaches every peer's buffer, the sum equals
    the unfused all-reduce's bits, the norm is RMSNorm's, and this rank's buffer is reset."""
    r = interpreted[f"embed_push-{case}-{dtype}"]
    assert r["sum_equal"] and r["norm_err"] < (1e-5 if dtype == "fp32" else 2e-3), r
    assert r["delivered"] and r["negative_zero_sent_as_zero"] and r["others_ids_zeros"], r
    assert r["own_buffer_reset"], r


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_push_all_gather_delivers_gathers_in_rank_order_and_resets(case, dtype, interpreted):
    r = interpreted[f"gather-{case}-{dtype}"]
    assert r == {"gathered": True, "delivered": True, "negative_zero_sent_as_zero": True, "own_buffer_reset": True}, r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_push_all_gather_builds_for_sm90_and_waits_first(world, pdl, compiled):
    r = compiled[f"gather-w{world}{'-pdl' if pdl else ''}"]
    assert r == {"ok": True, "pdl": "ok", "spills": 0}, r


@pytest.mark.parametrize("dtype", DTYPES)
def test_set_up_probe_checks_the_push_kernel_and_its_embedding_variant(dtype, interpreted):
    """The probe enable_symmetric runs on every rank before trusting the push kernel: it builds
    (compile_only) and runs both variants and the push all-gather with known values and leaves
    every buffer marked."""
    r = interpreted[f"probe-{dtype}"]
    assert r == {"compile_only": "", "launched": "", "reset": True}, r


@pytest.mark.parametrize("kind", ["gemv_push_norm", "gemv_push_norm1", "w8a16_push_norm", "w8a16_push_norm1"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_push_with_norm_ends_the_all_reduce_in_its_last_program(kind, case, dtype, interpreted):
    """One launch (NORM_N): the GEMV (16-bit or W8A16) delivers its rows into every peer's buffer
    (zeros as +0.0: the marker never goes out), and its last program waits, sums, adds and normalizes, in column
    chunks (16 of 40: three passes) or in
    one, resets this rank's buffer, and writes nothing else into the peers' buffers."""
    r = interpreted[f"{kind}-{case}-{dtype}"]
    tol = 1e-5 if dtype == "fp32" else 2e-3
    assert r["sum_err"] <= tol and r["norm_err"] < tol, r
    assert r["delivered_close"] and r["no_negative_zero_sent"] and r["own_buffer_reset"], r
    assert r["peers_untouched"], r


def test_kernels_build_for_sm90_and_pdl_waits_before_touching_rows(compiled):
    assert len(compiled) == 28 and sum(k.endswith("-pdl") for k in compiled) == 14, list(compiled)
    w8 = {k: v for k, v in compiled.items() if k.startswith("w8a16_push_norm")}
    assert len(w8) == 8 and all(v["fast_cvt"] and v["chunk"] == 4096 for v in w8.values()), w8
    assert all(f"embed_push-w{w}{p}" in compiled for w in (2, 4) for p in ("", "-pdl")), list(compiled)
    bad = {k: v for k, v in compiled.items() if not v["ok"] or v["pdl"] != "ok" or v.get("spills", 0)}
    assert not bad, bad
    # the GEMV + all-reduce end: a 4096-wide row in one pass, at 4 warps at tp 2 and 8 at tp 4;
    # an 8192-wide one at tp 4 in two
    assert [
        (compiled[f"gemv_push_norm{c}-w{w}"]["warps"], compiled[f"gemv_push_norm{c}-w{w}"]["chunk"])
        for c, w in (("", 2), ("", 4), ("_chunked", 4))
    ] == [(4, 4096), (8, 4096), (8, 4096)], compiled


def test_w8a16_push_config_takes_the_push_rows_as_launch_options_only():
    """--int8's GEMV push config: the W8A16 GEMV row, with the table's `w8a16_gemv_push` row over it
    where one ships (Llama-8B's tp=4 o_proj and down_proj: 16 rows, 8 warps, which the all-reduce's
    end keeps: 256 programs, one wave at two per SM) and only its config keys (a row's "source"
    must not reach the launch as a constexpr); elsewhere the W8A16 GEMV row unchanged."""
    for n, k in ((4096, 1024), (4096, 3584)):
        cfg = C.w8a16_push_config(n, k, 0, "sm_90")
        assert set(cfg) <= set(int8.W8A16_GEMV_KEYS) and (cfg["BLOCK_N"], cfg["num_warps"]) == (16, 8), cfg
        raised = C.gemv_push_norm_config(cfg, n, 4)
        assert (raised["BLOCK_N"], raised["num_warps"], n // raised["BLOCK_N"]) == (16, 8, 256), raised
    for n, k in ((4096, 2048), (4096, 7168)):  # tp=2: no push row
        assert C.w8a16_push_config(n, k, 0, "sm_90") == int8.int8_config("w8a16_gemv", 1, n, k, 0, "sm_90")


if __name__ == "__main__":
    {"interpret": run_interpreted, "aot": run_aot}[sys.argv[1]](sys.argv[2])


def test_gemv_push_config_is_the_gemv_row_with_the_push_row_over_it():
    """kernels/tuning.json's gemv_push row (measured at Llama-8B's tp=4 o_proj) overrides the
    shape's GEMV tiles; other shapes push with their GEMV config; no GEMV row: cuBLAS, no push."""
    from dsc.kernels.launch import tuning_table
    from dsc.kernels.linear import gemv_config

    push = tuning_table()["sm_90"]["gemv_push"]["N4096_K1024"]
    got = C.gemv_push_config(4096, 1024, "sm_90")
    assert got == {**gemv_config(4096, 1024, "sm_90"), **{k: push[k] for k in ("BLOCK_N", "BLOCK_K", "num_warps")}}
    assert "N4096_K14336" not in tuning_table()["sm_90"]["gemv_push"]  # a shape without a push row
    assert C.gemv_push_config(4096, 14336, "sm_90") == gemv_config(4096, 14336, "sm_90") is not None
    assert C.gemv_push_config(4096, 1000, "sm_90") is None  # untuned: cuBLAS, then the fused all-reduce
