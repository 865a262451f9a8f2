"""GPU check section `collectives` (2+ GPUs): dsc.all_reduce's default path (the one-shot
symmetric-memory all-reduce, the fused all-reduce + residual add + RMSNorm, the vocab-parallel
embedding + all-reduce + RMSNorm and the row-parallel linear whose GEMV pushes its rows) against
exact sums, and its time against NCCL, captured in CUDA graphs as a decode step runs them.

    pytest tests/gpu/test_gpu_collectives.py                                   # torchrun at 2 and 4 ranks where the
    GPUs are there
    torchrun --nproc-per-node 4 tests/gpu/test_gpu_collectives.py              # one world by hand;
    $OUT/gpu_collectives-tp4.json

Correctness, every rank: a CUDA graph of 65 all-reduces (odd: the last one on buffer 2) and one
of 64, replayed in turns with eager programs of 3 and 2 between them, 100 rounds; every third
call is a plain all-reduce, the others the fused all-reduce + add + RMSNorm (as a Llama decode
step mixes the embedding's all-reduce with the layers' fused ones). Each all-reduce sums small
integers (exact in bf16) that differ per call, per rank and per round, and before each one a
different rank spins for a while (torch.cuda._sleep) so the ranks run out of step: a rank that
overwrote a buffer (or set a flag) a peer still reads gives a wrong sum. Every sum is compared
with the exact sum; the fused op's sum + residual must be exact too, and its normalized output
equal to dsc.add_rmsnorm's of the exact sum within one bf16 rounding. The same again with every
third call the vocab-parallel embedding + all-reduce + RMSNorm (token i one rank's row i; the sum
exact, the norm dsc.rmsnorm's within one rounding), then at one row with every third call the
row-parallel linear + all-reduce + add + RMSNorm (dsc.linear_all_reduce_add_rmsnorm: the weight
selects x's columns, so the sums stay exact). The same run with one buffer for every call (the
order the double buffering prevents) is reported too, as a control of whether skew exposes reuse.

Timing: graphs of 64 back-to-back all-reduces of [rows, 4096] bf16 (rows 1, 8, 64: decode at
batch 1/8/64 of a 4096-wide model) and [2048, 4096] (prefill, NCCL only), us per all-reduce:
the default path and NCCL (DSC_ALLREDUCE=nccl's), alone and with add + RMSNorm, in the same
process; at one row also the row-parallel linear before it. The kernels launch as the runtime's
would: with PDL (DSC_PDL=auto); DSC_PDL=off checks and times them without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from gpu_util import ROOT, write_summary
from timing import capture

from dsc.kernels import collectives
from dsc.runtime.distributed import ensure_process_group, shutdown_process_group

HIDDEN = 4096


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


def program(
    inputs, rank, world, skew, residual=None, weight=None, fused=lambda k: k % 3 != 0, lin_weight=None, lookup=None
):
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
                outs.append(
                    torch.ops.dsc.linear_all_reduce_add_rmsnorm(residual, x[..., :K_LIN], lin_weight, weight, EPS)
                )
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
    inputs = {
        k: [torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device=dev) for _ in range(n)] for k, n in sizes.items()
    }
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

    def run(name):
        return program(
            inputs[name],
            rank,
            world,
            skew,
            residual,
            weight,
            lin_weight=lin_weight,  # noqa: E731
            lookup=lookup if embed else None,
        )

    fill(0)
    g65, o65 = capture(lambda: run("graph65"))
    g64, o64 = capture(lambda: run("graph64"))
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


def time_linear(k, n=64, iters=50):
    """us per call of a graph of n row-parallel linears [1, k] x [HIDDEN, k]^T + all-reduce + add +
    RMSNorm at one row (dsc.linear_all_reduce_add_rmsnorm)."""
    xs = [torch.randn(1, k, device="cuda").to(torch.bfloat16) for _ in range(n)]
    res = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    lw = (torch.randn(HIDDEN, k, device="cuda") / k**0.5).to(torch.bfloat16)

    def prog():
        with collectives.program_scope(n):
            return [torch.ops.dsc.linear_all_reduce_add_rmsnorm(res, x, lw, w, EPS) for x in xs]

    g, _ = capture(prog)
    return replay_us_all_ranks(g, n, iters)


def replay_us_all_ranks(g, n, iters):
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


def time_graph(rows, n=64, iters=50, norm=False):
    """us per call of a graph of n calls: all-reduces, or with norm all-reduce + add + RMSNorm
    (fused where the fused path is on, else the all-reduce and the add_rmsnorm kernel)."""
    xs = [torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(n)]
    res = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16) if norm else None
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    g, _ = capture(lambda: program(xs, 0, 1, 0, res, w, fused=lambda k: True))
    return replay_us_all_ranks(g, n, iters)


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
    fused = path.startswith("symm_mem+norm")
    if fused:
        default = symm.fused
        bad, total = check(rank, world, dev)
        res["check_default"] = {"wrong": bad, "all_reduces": total}
        # every third call the vocab-parallel embedding + all-reduce + RMSNorm
        bad, total = check(rank, world, dev, embed=True)
        res["check_default_embed"] = {"wrong": bad, "all_reduces": total}
        progress(f"checked the default path: {res['check_default']}; with the embedding: {res['check_default_embed']}")
        # one row, every third call the linear whose GEMV pushes its rows and ends the all-reduce
        bad, total = check(rank, world, dev, rows=1, linear=True)
        res["check_gemv_push_norm"] = {"wrong": bad, "all_reduces": total}
        progress(f"checked gemv_push_norm: {res['check_gemv_push_norm']}")
        # control: one buffer for every call, plain all-reduces only (the fused kernels would
        # hang on a reused buffer or flag, not give a wrong sum)
        slot = collectives._Symmetric.slot
        collectives._Symmetric.slot = lambda self: (slot(self), 0)[1]
        symm.fused = False
        bad1, _ = check(rank, world, dev, rounds=30)
        collectives._Symmetric.slot = slot
        symm.fused = default
        res["control_one_buffer_wrong"] = bad1
    progress("checks done; timing")
    timing = {}
    for rows in (1, 8, 64, 2048):
        row = {}
        if fused and rows <= 64:
            row["default_us"] = time_graph(rows)
            row["default_norm_us"] = time_graph(rows, norm=True)
            if rows == 1:  # + the row-parallel linear before it: one launch
                row["gemv_push_norm_us"] = time_linear(K_LIN)
        collectives._symm = None
        row["nccl_us"] = time_graph(rows)
        row["nccl_then_norm_us"] = time_graph(rows, norm=True)
        collectives._symm = symm
        if "default_us" in row:
            row["speedup"] = row["nccl_us"] / row["default_us"]
        timing[rows] = row
    res["timing_bf16_x4096"] = timing
    # every rank's wrong count: a wrong sum on any rank is a failure
    wrong = [None] * world
    dist.all_gather_object(wrong, sum(v["wrong"] for k, v in res.items() if k.startswith("check_")) if fused else None)
    res["wrong_per_rank"] = wrong
    if rank == 0:
        print(json.dumps(res, indent=1))
        write_summary(f"gpu_collectives-tp{world}", res)
    ok = fused and all(w == 0 for w in wrong)
    shutdown_process_group()
    sys.exit(0 if ok else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_paths_exact_under_skew(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            str(ROOT / "tests" / "gpu" / "test_gpu_collectives.py"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


if __name__ == "__main__":
    main()
