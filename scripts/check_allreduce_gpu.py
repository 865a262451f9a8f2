"""Check and time dsc.all_reduce's paths on several GPUs: the one-shot symmetric-memory
all-reduce, the fused all-reduce + residual add + RMSNorm (dsc.all_reduce_add_rmsnorm) and NCCL
(kernels/collectives.py), captured in CUDA graphs as a decode step runs them.

    torchrun --nproc-per-node 4 scripts/check_allreduce_gpu.py     # writes $OUT/allreduce-tp4.json

Correctness, every rank: a CUDA graph of 65 all-reduces (odd: the last one on buffer 2) and one
of 64, replayed in turns with eager programs of 3 and 2 between them, 100 rounds; every third
call is a plain all-reduce, the others the fused all-reduce + add + RMSNorm (as a Llama decode
step mixes the embedding's all-reduce with the layers' fused ones). Each all-reduce sums small
integers (exact in bf16) that differ per call, per rank and per round, and before each one a
different rank spins for a while (torch.cuda._sleep) so the ranks run out of step: a rank that
overwrote a buffer (or set a flag) a peer still reads gives a wrong sum. Every sum is compared
with the exact sum; the fused op's sum + residual must be exact too, and its normalized output
equal to dsc.add_rmsnorm's of the exact sum within one bf16 rounding. This runs once with the
push kernel (the default) and once with the pull kernel (DSC_ALLREDUCE=pull), each also with every
third call the vocab-parallel embedding + all-reduce + RMSNorm
(dsc.vocab_embedding_all_reduce_rmsnorm: the push kernel looking its row up; token i one rank's
row i; the sum exact, the norm dsc.rmsnorm's within one rounding), then at one row
with every third call the row-parallel linear + all-reduce + add + RMSNorm
(dsc.linear_all_reduce_add_rmsnorm: its GEMV pushes its rows; the weight selects x's columns,
so the sums stay exact), twice: the GEMV's last program ending the all-reduce (the default),
and the GEMV then the push kernel (DSC_ALLREDUCE=gemv_push). The same run with one
buffer for every call (the order the double buffering prevents) is reported too, as a control
of whether skew exposes reuse.

Timing: graphs of 64 back-to-back all-reduces of [rows, 4096] bf16 (rows 1, 8, 64: decode at
batch 1/8/64 of a 4096-wide model) and [2048, 4096] (prefill, NCCL only), us per all-reduce:
one-shot and NCCL alone, and all-reduce + add + RMSNorm as the fused kernels (push, pull), as the one-shot
all-reduce + the add_rmsnorm kernel, and as NCCL + the add_rmsnorm kernel, in the same process;
at one row also the linear before it: the GEMV then the push kernel (DSC_ALLREDUCE=push), the
GEMV pushing its rows then the push kernel (DSC_ALLREDUCE=gemv_push), and the GEMV pushing its
rows and ending the all-reduce (the default), with the tuned config and with more rows per
program. GEMV_PUSH_SWEEP=1 also sweeps GEMV push configs at Llama-8B's row-parallel shapes for
this tp and proposes kernels/tuning.json `gemv_push` rows (JSON key gemv_push_sweep).

The kernels launch as the runtime's would: with PDL (DSC_PDL=auto, kernels/launch.py; sessions
12-16 ran tp=2 without it); DSC_PDL=off checks and times the variants without it.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsc.kernels import collectives
from dsc.runtime.distributed import ensure_process_group, shutdown_process_group

HIDDEN = 4096


@contextlib.contextmanager
def allreduce_env(mode):
    prev = os.environ.get("DSC_ALLREDUCE")
    os.environ["DSC_ALLREDUCE"] = mode
    try:
        yield
    finally:
        os.environ.pop("DSC_ALLREDUCE") if prev is None else os.environ.update(DSC_ALLREDUCE=prev)


@contextlib.contextmanager
def gemv_push_config(cfg):
    """The GEMV push kernel with `cfg` instead of its table config (timing only)."""
    orig = collectives.gemv_push_config
    collectives.gemv_push_config = lambda n, k, arch: dict(cfg)
    try:
        yield
    finally:
        collectives.gemv_push_config = orig


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


EPS = 1e-5


K_LIN = 1024  # the linear calls: x [1, K_LIN] @ SELECT.T, Llama-8B's o_proj shape at tp=4


def select_weight(dev):
    """[HIDDEN, K_LIN] bf16 with w[n, n % K_LIN] = 1, else 0: the linear's output is x[n % K_LIN],
    exact, so its all-reduce can be checked exactly."""
    n = torch.arange(HIDDEN, device=dev)
    w = torch.zeros(HIDDEN, K_LIN, dtype=torch.bfloat16, device=dev)
    w[n, n % K_LIN] = 1
    return w


def linear_call(k, lin_weight):
    return lin_weight is not None and k % 3 == 2


def program(inputs, rank, world, skew, residual=None, weight=None, fused=lambda k: k % 3 != 0, lin_weight=None,
            lookup=None):
    """All-reduce each input in turn, call k fused with add + RMSNorm where fused(k) (and a
    residual is given), and with lin_weight every third call the row-parallel linear + all-reduce
    + add + RMSNorm of x[..., :K_LIN] (the GEMV that pushes its rows); with lookup = (ids, start)
    the other calls are the vocab-parallel embedding + all-reduce + RMSNorm, x the rank's rows of
    the table; before call k, rank k % world spins `skew` cycles."""
    outs = []
    with collectives.program_scope(len(inputs)):
        for k, x in enumerate(inputs):
            if skew and k % world == rank:
                torch.cuda._sleep(skew)
            if residual is not None and fused(k) and linear_call(k, lin_weight):
                outs.append(torch.ops.dsc.linear_all_reduce_add_rmsnorm(residual, x[..., :K_LIN], lin_weight, weight,
                                                                        EPS))
            elif residual is not None and fused(k):
                outs.append(torch.ops.dsc.all_reduce_add_rmsnorm(residual, x, weight, EPS))
            elif lookup is not None:
                outs.append(torch.ops.dsc.vocab_embedding_all_reduce_rmsnorm(x, *lookup, weight, EPS))
            else:
                outs.append(torch.ops.dsc.all_reduce(x))
    return outs


def check(rank, world, dev, rounds=100, skew=20000, rows=8, linear=False, embed=False):
    sizes = {"graph65": 65, "graph64": 64, "eager3": 3, "eager2": 2}
    salts = {"graph65": 0, "graph64": 1, "eager3": 2, "eager2": 4}
    inputs = {k: [torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device=dev) for _ in range(n)]
              for k, n in sizes.items()}
    base = torch.arange(rows * HIDDEN, device=dev).view(rows, HIDDEN)

    def fill(r):
        for name, xs in inputs.items():
            for k, x in enumerate(xs):  # small integers: exact sums in bf16
                salt = salts[name] + 3 * k + 5 * r
                x.copy_(((base + salt + 11 * rank) % 13).to(torch.bfloat16))

    # embed: token i is rank i % world's row i (ids from rank q's start q * rows)
    owner = (torch.arange(rows, device=dev) % world)[:, None]
    lookup = ((owner[:, 0] * rows + torch.arange(rows, device=dev)), torch.tensor([rank * rows], device=dev))

    def want(name, k, r):
        salt = salts[name] + 3 * k + 5 * r
        if embed and not k % 3:  # the owner's row: the others add zeros
            return ((base + salt + 11 * owner) % 13).to(torch.bfloat16)
        return sum(((base + salt + 11 * q) % 13) for q in range(world)).to(torch.bfloat16)

    residual = ((base % 7) - 3).to(torch.bfloat16)  # small integers: sum + residual stays exact
    weight = (1 + (torch.arange(HIDDEN, device=dev) % 5) / 4).to(torch.bfloat16)

    def wrong(out, sum_, lookup_call):
        if isinstance(out, torch.Tensor):
            return not torch.equal(out, sum_)
        s, y = out
        if lookup_call:
            s_ref, y_ref = sum_, torch.ops.dsc.rmsnorm(sum_, weight, EPS)
        else:
            s_ref, y_ref = torch.ops.dsc.add_rmsnorm(sum_, residual, weight, EPS)
        # y: the two kernels reduce the sum of squares in different orders, so allow one rounding
        return not torch.equal(s, s_ref) or not torch.allclose(y.float(), y_ref.float(), rtol=8e-3, atol=1e-6)

    lin_weight = select_weight(dev) if linear else None
    pick = torch.arange(HIDDEN, device=dev) % K_LIN
    run = lambda name: program(inputs[name], rank, world, skew, residual, weight, lin_weight=lin_weight,  # noqa: E731
                               lookup=lookup if embed else None)
    fill(0)
    g65, o65 = graph_of(lambda: run("graph65"))
    g64, o64 = graph_of(lambda: run("graph64"))
    bad = 0
    for r in range(rounds):
        fill(r)
        g65.replay()
        e3 = run("eager3")
        g64.replay()
        e2 = run("eager2")
        torch.cuda.synchronize()
        for name, outs in (("graph65", o65), ("eager3", e3), ("graph64", o64), ("eager2", e2)):
            for k, o in enumerate(outs):
                w = want(name, k, r)
                bad += int(wrong(o, w[:, pick] if linear_call(k, lin_weight) else w, embed and not k % 3))
    return bad, rounds * sum(sizes.values())


def time_linear(k, cfg=None, n=64, iters=50):
    """us per call of a graph of n row-parallel linears [1, k] x [HIDDEN, k]^T + all-reduce + add +
    RMSNorm at one row (dsc.linear_all_reduce_add_rmsnorm), with the GEMV push config `cfg`
    (None: the table's)."""
    xs = [torch.randn(1, k, device="cuda").to(torch.bfloat16) for _ in range(n)]
    res = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    lw = (torch.randn(HIDDEN, k, device="cuda") / k ** 0.5).to(torch.bfloat16)

    def prog():
        with collectives.program_scope(n):
            return [torch.ops.dsc.linear_all_reduce_add_rmsnorm(res, x, lw, w, EPS) for x in xs]

    with gemv_push_config(cfg) if cfg else contextlib.nullcontext():
        g, _ = graph_of(prog)
    return replay_us(g, n, iters)


def replay_us(g, n, iters):
    """us per call of graph g of n calls: warm-up, a barrier (every rank starts together), iters replays."""
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters / n * 1e6


def sweep_gemv_push(world):
    """GEMV_PUSH_SWEEP=1: GEMV push configs at Llama-8B's row-parallel shapes for this tp (o_proj
    [4096, 4096 / tp], down_proj [4096, 14336 / tp]), against the table's config and against the
    GEMV then the push kernel (DSC_ALLREDUCE=push); the best per shape as a kernels/tuning.json
    `gemv_push` row (its us and the table config's us kept, as scripts/tune_gemv.py keeps both)."""
    out = {}
    for k in (4096 // world, 14336 // world):
        table_us = time_linear(k)
        with allreduce_env("push"):
            push_us = time_linear(k)
        best, tried = (table_us, None), {}
        for bn, bk, warps in itertools.product((1, 2, 4, 8), (128, 256, 512, 1024), (1, 2, 4)):
            if not 8 <= bn * bk // (32 * warps) <= 64 or bk > k:  # elements per thread and K-block
                continue
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
            tried[f"bn{bn}_bk{bk}_w{warps}"] = us = time_linear(k, cfg)
            if us < best[0]:
                best = (us, cfg)
        row = {**best[1], "us": round(best[0], 2), "gemv_config_us": round(table_us, 2)} if best[1] else None
        out[f"N{HIDDEN}_K{k}"] = {"table_us": table_us, "gemv_then_push_us": push_us, "tried": tried, "row": row}
    return out


def time_graph(rows, n=64, iters=50, norm=False):
    """us per call of a graph of n calls: all-reduces, or with norm all-reduce + add + RMSNorm
    (fused where the fused path is on, else the all-reduce and the add_rmsnorm kernel)."""
    xs = [torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(n)]
    res = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16) if norm else None
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    g, _ = graph_of(lambda: program(xs, 0, 1, 0, res, w, fused=lambda k: True))
    return replay_us(g, n, iters)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t0 = time.perf_counter()

    def progress(what):  # rank 0, as it goes: a check cut off by its timeout shows how far it got
        if rank == 0:
            print(f"[{time.perf_counter() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)

    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    ensure_process_group(dev, world, rank)
    res = {"world": world, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    path = collectives.enable_symmetric(dev, torch.bfloat16, 64 * HIDDEN, 64)
    res["path"] = path
    progress(f"set-up (the probe included): {path}")
    symm = collectives._symm
    kernels = ["push", "pull"] if path.startswith("symm_mem+norm") else []
    if path.startswith("symm_mem"):
        for kernel in kernels or [""]:  # the push kernel (default), then the pull kernel
            symm.fused = kernel
            bad, total = check(rank, world, dev)
            res[f"check_{kernel or 'one_shot'}"] = {"wrong": bad, "all_reduces": total}
            # every third call the vocab-parallel embedding + all-reduce + RMSNorm (one push
            # kernel; with the pull kernel or none, the lookup, the all-reduce and the norm)
            bad, total = check(rank, world, dev, embed=True)
            res[f"check_{kernel or 'one_shot'}_embed"] = {"wrong": bad, "all_reduces": total}
            name = kernel or "one_shot"
            progress(f"checked {name}: {res[f'check_{name}']}; with the embedding: {res[f'check_{name}_embed']}")
        if kernels:  # one row, every third call the linear whose GEMV pushes its rows: the GEMV
            symm.fused = "push"  # ending the all-reduce (default), then the GEMV and the push kernel
            for mode, key in (("auto", "check_gemv_push_norm"), ("gemv_push", "check_gemv_push")):
                with allreduce_env(mode):
                    bad, total = check(rank, world, dev, rows=1, linear=True)
                res[key] = {"wrong": bad, "all_reduces": total, "gemv_push_error": collectives._gemv_push_error}
                progress(f"checked {key[6:]}: {res[key]}")
        # control: one buffer for every call, plain all-reduces only (the fused kernels would
        # hang on a reused buffer or flag, not give a wrong sum)
        slot = collectives._Symmetric.slot
        collectives._Symmetric.slot = lambda self: (slot(self), 0)[1]
        symm.fused = ""
        bad1, _ = check(rank, world, dev, rounds=30)
        collectives._Symmetric.slot = slot
        res["control_one_buffer_wrong"] = bad1
    progress("checks done; timing")
    timing = {}
    for rows in (1, 8, 64, 2048):
        row = {}
        if symm is not None and rows <= 64:
            symm.fused = ""
            row["one_shot_us"] = time_graph(rows)
            row["one_shot_then_norm_us"] = time_graph(rows, norm=True)
            for kernel in kernels:
                symm.fused = kernel
                row[f"fused_{kernel}_norm_us"] = time_graph(rows, norm=True)
            if kernels and rows == 1:  # + the row-parallel linear before it
                symm.fused = "push"
                with allreduce_env("push"):  # the GEMV, then the push kernel
                    row["gemv_then_push_norm_us"] = time_linear(K_LIN)
                with allreduce_env("gemv_push"):  # the GEMV pushing its rows, then the push kernel
                    row["gemv_push_then_norm_us"] = time_linear(K_LIN)
                with allreduce_env("auto"):  # one launch: the GEMV pushing its rows ends the all-reduce
                    row["gemv_push_norm_us"] = time_linear(K_LIN)
                    # more rows per program: fewer, larger stores to the peers
                    for bn, warps in ((4, 4), (8, 4), (16, 4), (16, 8)):
                        cfg = {"BLOCK_N": bn, "BLOCK_K": 128, "num_warps": warps}
                        row[f"gemv_push_norm_us_bn{bn}_w{warps}"] = time_linear(K_LIN, cfg)
        collectives._symm = None
        row["nccl_us"] = time_graph(rows)
        row["nccl_then_norm_us"] = time_graph(rows, norm=True)
        collectives._symm = symm
        if "one_shot_us" in row:
            row["speedup"] = row["nccl_us"] / row["one_shot_us"]
        timing[rows] = row
    if symm is not None:
        symm.fused = kernels[0] if kernels else ""
    res["timing_bf16_x4096"] = timing
    if kernels and os.environ.get("GEMV_PUSH_SWEEP"):  # timing only: a failure here fails no check
        symm.fused = "push"
        try:
            res["gemv_push_sweep"] = sweep_gemv_push(world)
        except Exception as e:  # noqa: BLE001
            res["gemv_push_sweep"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        symm.fused = kernels[0]
    # every rank's wrong count: a wrong sum on any rank is a failure
    wrong = [None] * world
    dist.all_gather_object(wrong, sum(v["wrong"] for k, v in res.items() if k.startswith("check_")) if kernels else None)
    res["wrong_per_rank"] = wrong
    if rank == 0:
        print(json.dumps(res, indent=1))
        out = os.environ.get("OUT")
        if out:
            Path(out, f"allreduce-tp{world}.json").write_text(json.dumps(res, indent=1))
    ok = path.startswith("symm_mem+norm") and all(w == 0 for w in wrong)
    shutdown_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
