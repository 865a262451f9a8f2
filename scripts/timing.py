"""The one timing helper of scripts/ and tests/gpu/, and the loader of this checkout's modules.

    from timing import bench_ms, capture, graph_us, replay_us, checkout_modules
    bench_ms(fn)                          # median ms of fn (triton's do_bench: warm-up, L2 flushed)
    capture(fn)                           # (CUDA graph, outputs) of fn, warmed up on a side stream
    graph_us([f, g, ...])                 # us per call of the fns captured in one CUDA graph
    replay_us({"on": g1, "off": g2})      # median us per replay of each graph, timed alternately
    NORM, ROT = checkout_modules("kernels.norm", "kernels.rotary")

Every time is a median over rounds after a warm-up; CUDA times come from CUDA events around
graph replays (what a decode step runs), or from triton.testing.do_bench for eager calls.
On the CPU (the scripts' smoke runs) the same helpers time with perf_counter.
The scripts run as `python scripts/X.py`, which puts this folder on sys.path; tests/gpu adds it.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def checkout_modules(*names: str) -> list:
    """[dsc.<name> for each name], e.g. "kernels.attention", "runtime.decode", from this checkout.

    Imports dsc.<name> without installing dsc and without dsc/__init__.py's imports: `dsc` and
    each name's package (`dsc.kernels`, `dsc.runtime`) become bare packages over the checkout's
    folders, unless a `dsc` is imported already. A script then needs torch and triton only."""
    packages = ["dsc", *sorted({"dsc." + name.rpartition(".")[0] for name in names if "." in name})]
    for package in packages:
        if package not in sys.modules:
            bare = types.ModuleType(package)
            bare.__path__ = [str(ROOT.joinpath(*package.split(".")[1:]))]
            sys.modules[package] = bare
    return [importlib.import_module(f"dsc.{name}") for name in names]


def _cuda() -> bool:
    return torch.cuda.is_available()


def bench_ms(fn, rep: int = 100, warmup: int = 25) -> float:
    """Median milliseconds of an eager call of fn: triton.testing.do_bench on CUDA (L2 flushed
    before every run), perf_counter medians on the CPU."""
    if not _cuda():
        return 1e3 * median_s(fn, rounds=1, warmup=1)  # a smoke run: the code path, not the time
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def median_s(fn, rounds: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn over `rounds` calls after `warmup` (host clock, device synced)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def capture(fn):
    """(graph, outputs) of fn captured in a CUDA graph, after a warm-up call on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_us(graphs: dict, rounds: int = 5, iters: int = 20, calls: int = 1) -> dict:
    """Median microseconds per replay (divided by `calls`, the calls each graph holds) of each
    graph, the graphs timed alternately: rounds x (one untimed replay, iters timed replays)."""
    us: dict = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                graph.replay()
            end.record()
            end.synchronize()
            us[name].append(start.elapsed_time(end) * 1e3 / iters / calls)
    return {name: statistics.median(v) for name, v in us.items()}


def graph_us(fns, iters: int = 30, rounds: int = 3) -> float:
    """Microseconds per call of fns (called in turn, e.g. each on its own weight copy past L2)
    captured in one CUDA graph, as a decode step replays them."""
    for f in fns:
        f()
    sync()
    graph, _ = capture(lambda: [f() for f in fns])
    return replay_us({"g": graph}, rounds=rounds, iters=iters, calls=len(fns))["g"]
