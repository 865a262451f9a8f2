"""Decode steps over static buffers, one per batch bucket; replayed from CUDA graphs on GPU.

A batch of B sequences runs in the smallest bucket >= B. Rows B..bucket-1 are padding: they
decode token 0 at position 0 into KV-cache rows that no live sequence uses (the cache has
max_batch rows and every bucket is <= max_batch), and their logits are dropped.

On CUDA each bucket's step is captured once (at load) into a CUDA graph; all graphs share one
memory pool, so the intermediates of a step are allocated once and reused by every replay
(the step's workspace is bounded by the largest bucket's). On CPU the same static-buffer path
runs eagerly, so bucket choice and padding are exercised everywhere.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch

_RUNNERS: weakref.WeakSet = weakref.WeakSet()  # decode and prefill runners (anything with release())
# seconds spent in capture_graph by this process: its warm-up runs ("kernels": the Triton JIT and
# cuBLAS set-up happen in the first of them) and the captures ("graphs"); the load timings read it
CAPTURE_TIMES: defaultdict[str, float] = defaultdict(float)


def capture_times_since(before: dict[str, float]) -> dict[str, float]:
    """CAPTURE_TIMES minus a copy of it taken earlier: the seconds spent since then, by stage."""
    return {k: v - before.get(k, 0.0) for k, v in CAPTURE_TIMES.items()}


def register_runner(runner) -> None:
    _RUNNERS.add(runner)


def release_cuda_graphs() -> None:
    """Destroy every live runner's CUDA graphs (their steps then run eagerly). Called before a
    process group is torn down: a graph that captured NCCL collectives keeps the communicator
    busy, and destroying the group then hangs in ncclCommDestroy (pytorch/pytorch#115388;
    seen here: tp=2/4 `dsc generate` on H200s printed its tokens and never exited)."""
    for runner in list(_RUNNERS):
        runner.release()


def capture_graph(
    forward: Callable[[], torch.Tensor], device: torch.device, pool
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm `forward` up on a side stream (Triton JIT, cuBLAS handles), then capture it into a
    CUDA graph in `pool`; returns the graph and the output tensor its replays write."""
    t0 = time.perf_counter()
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    CAPTURE_TIMES["kernels"] += t1 - t0
    CAPTURE_TIMES["graphs"] += time.perf_counter() - t1
    return graph, out


def reset_graphs(steps) -> None:
    """Destroy the CUDA graphs of these static-buffer steps (each with .graph, .logits, .device);
    they then run eagerly."""
    for step in steps:
        if step.graph is not None:
            torch.cuda.synchronize(step.device)
            step.graph.reset()
        step.graph, step.logits = None, None


def choose_bucket(buckets: tuple[int, ...] | list[int], batch: int) -> int:
    """Smallest bucket that holds `batch` sequences."""
    i = bisect.bisect_left(list(buckets), batch)
    if i == len(buckets):
        raise ValueError(f"batch {batch} exceeds the largest decode bucket {buckets[-1]}")
    return buckets[i]


class DecodeStep:
    """Static input/output buffers for one bucket, and the step that fills the output."""

    def __init__(self, program: Callable, bucket: int, device: torch.device):
        self.program, self.bucket, self.device = program, bucket, device
        self.tokens = torch.zeros(bucket, 1, dtype=torch.long, device=device)  # [b, 1]
        self.pos = torch.zeros(bucket, dtype=torch.long, device=device)  # [b]
        self.zeros = torch.zeros(bucket, dtype=torch.long, device=device)  # last_idx: [b]
        self.logits: torch.Tensor | None = None  # [b, V], written by the step
        self.graph: torch.cuda.CUDAGraph | None = None

    def _forward(self) -> torch.Tensor:
        return self.program(self.tokens, self.pos[:, None], self.pos, self.zeros)

    def capture(self, pool) -> None:
        self.graph, self.logits = capture_graph(self._forward, self.device, pool)

    def __call__(self, tokens: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
        """tokens, cache_pos: [B] with B <= bucket -> logits [B, V]."""
        B = tokens.shape[0]
        self.tokens[:B, 0].copy_(tokens)
        self.pos[:B].copy_(cache_pos)
        if B < self.bucket:
            self.tokens[B:].zero_()
            self.pos[B:].zero_()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._forward()
        assert self.logits is not None  # capture set it with the graph
        return self.logits[:B]


class DecodeRunner:
    """All buckets of one program; capture on CUDA at construction."""

    def __init__(self, program: Callable, buckets: tuple[int, ...], device: torch.device, cuda_graphs: bool):
        self.buckets = tuple(buckets)
        self.steps = {b: DecodeStep(program, b, device) for b in self.buckets}
        self.captured = False
        if cuda_graphs and device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
            for b in sorted(self.buckets, reverse=True):  # largest first: smaller ones reuse its pool
                self.steps[b].capture(pool)
            torch.cuda.synchronize(device)
            self.captured = True
            register_runner(self)

    def release(self) -> None:
        if not self.captured:
            return
        reset_graphs(self.steps.values())
        self.captured = False

    def __call__(self, tokens: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
        return self.steps[choose_bucket(self.buckets, tokens.shape[0])](tokens, cache_pos)
