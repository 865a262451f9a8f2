"""What a kernel boundary costs in a CUDA graph on this GPU, against handing data over by a flag.

    python3 scripts/bench_boundary.py [--kernels 256] [--replays 50]   # one GPU, about 20 s

A decode step is a chain of dependent kernels; at tp=4 on an H200 each layer's five launches
stream their weights in about 25 us and take about 41 (docs/closing-note.md). This measures the
chain's fixed cost per link, with kernels that do nearly nothing (each program loads one word
the previous kernel stored and stores it plus one), captured in one CUDA graph and replayed:

  plain  each kernel a normal launch: it starts when the previous one has finished
  pdl    launched with PDL (kernels/launch.py): each kernel lets the next launch at its top,
         then waits (griddepcontrol.wait) for the previous one to finish before its load
  flag   launched with PDL, but a kernel's programs wait for the previous kernel's last
         program to publish its word (a release store of this replay's epoch into a flag,
         polled with acquire loads) instead of waiting for that whole kernel to finish; each
         still waits for the previous kernel before it exits, as every PDL kernel of dsc does.
         This is the hand-over a GEMV that follows the all-reduce's last program could use.

Each at 1, 132 and 264 programs. Prints microseconds per link (median of rounds) and the
differences; writes $OUT/bench_boundary.json when OUT is set. torch and triton only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _link(X, FLAGS, EPOCH, i, MODE: tl.constexpr):
    # MODE 0 plain, 1 pdl, 2 flag. X [programs, kernels + 1] int32: program p reads column i and
    # writes column i + 1 (its own word; the flag mode's hand-over is the last program's)
    p = tl.program_id(0)
    n = tl.num_programs(0)
    if MODE != 0:
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
    if MODE == 2:
        e = tl.load(EPOCH)
        if i > 0:
            seen = tl.atomic_add(FLAGS + i - 1, 0, sem="acquire", scope="gpu")
            while seen != e:
                seen = tl.atomic_add(FLAGS + i - 1, 0, sem="acquire", scope="gpu")
        v = tl.load(X + (n - 1) * 4096 + i, cache_modifier=".cg")  # the handed-over word
    else:
        v = tl.load(X + p * 4096 + i)
    tl.store(X + p * 4096 + i + 1, v + 1)
    if MODE == 2:
        if p == n - 1:
            tl.debug_barrier()
            tl.atomic_xchg(FLAGS + i, e, sem="release", scope="gpu")
        tl.extra.cuda.gdc_wait()


@triton.jit
def _bump(EPOCH):
    tl.store(EPOCH, tl.load(EPOCH) + 1)


def chain_us(mode: int, programs: int, kernels: int, replays: int, rounds: int = 5) -> float:
    x = torch.zeros(programs, 4096, dtype=torch.int32, device="cuda")
    flags = torch.zeros(kernels, dtype=torch.int32, device="cuda")
    epoch = torch.zeros(1, dtype=torch.int32, device="cuda")
    pdl = mode != 0

    def step():
        _bump[(1,)](epoch)
        for i in range(kernels):
            _link[(programs,)](x, flags, epoch, i, MODE=mode, num_warps=4, launch_pdl=pdl)

    step()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            step()
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / replays / kernels)
    if mode == 2:  # every link ran: the epoch reached every flag
        assert int(flags.min()) == int(epoch.item()), (flags.min().item(), epoch.item())
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=256)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}: us per link, chains of {args.kernels} kernels in one CUDA graph")
    print(f"{'programs':>8} {'plain':>7} {'pdl':>7} {'flag':>7} {'pdl-flag':>9}")
    for programs in (1, 132, 264):
        us = {name: chain_us(mode, programs, args.kernels, args.replays)
              for mode, name in enumerate(("plain", "pdl", "flag"))}
        rows.append({"programs": programs, **us})
        print(f"{programs:>8} {us['plain']:>7.2f} {us['pdl']:>7.2f} {us['flag']:>7.2f} {us['pdl'] - us['flag']:>9.2f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_boundary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
