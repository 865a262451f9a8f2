"""Prefill over static buffers, one per (batch, prompt-length bucket); replayed from CUDA graphs.

A prefill program run eagerly costs its Python and launch overhead on every call: hundreds of
ops per layer-stack, each a dispatcher call and a Triton launch, ~30 ms for a 32-layer model
whatever the prompt length, several times the GPU time of a short prompt (and under tensor
parallelism every all-reduce waits for the slowest rank's host). So on CUDA a prefill of B
prompts whose longest has L tokens runs in the (B, Lb) graph, Lb the smallest length bucket
>= L (powers of two from 16; max_seq last). Prompts are right-padded with token 0 to Lb, as
they already are to L: attention is causal, so padding changes no real token's values; it
writes KV-cache slots past each prompt's end, which a decode step overwrites (slot p) before
any step reads it (a step at position p reads slots 0..p).

Graphs are captured on first use of a shape (warm-up on a side stream, then capture, then
replay: the first call of a shape costs about three eager runs) and share one memory pool of
their own. Prefills of more than `max_graph_tokens` tokens (B x Lb) run eagerly at their
exact length: their GPU time dwarfs the launch overhead, and their workspace would stay
reserved in the pool. Under tensor parallelism every rank prefills the same shapes in the same
order, so the ranks capture (and replay) their collectives in lockstep. A capture that raises
(an op that cannot be captured) prints one line and turns the runner eager: a rank that falls
back still issues the same collectives in the same order as its peers' replays.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from dsc.runtime.decode import capture_graph, register_runner

MIN_BUCKET = 16


def length_buckets(max_seq: int) -> tuple[int, ...]:
    """Powers of two from MIN_BUCKET below max_seq, then max_seq."""
    out, n = [], MIN_BUCKET
    while n < max_seq:
        out.append(n)
        n *= 2
    return tuple(out) + (max_seq,)


class PrefillStep:
    """Static inputs of one (batch, length) shape and its captured graph."""

    def __init__(self, program: Callable, batch: int, length: int, device: torch.device):
        self.program, self.device = program, device
        self.ids = torch.zeros(batch, length, dtype=torch.long, device=device)
        self.pos = torch.arange(length, device=device).expand(batch, length).contiguous()
        self.zeros = torch.zeros(batch, dtype=torch.long, device=device)  # cache_pos: a fresh prompt
        self.last = torch.zeros(batch, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def _forward(self) -> torch.Tensor:
        return self.program(self.ids, self.pos, self.zeros, self.last)

    def capture(self, pool) -> None:
        self.graph, self.logits = capture_graph(self._forward, self.device, pool)

    def __call__(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        L = ids.shape[1]
        self.ids[:, :L].copy_(ids)
        self.ids[:, L:].zero_()  # the padding (a no-op when L is the bucket)
        self.last.copy_(last)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._forward()
        assert self.logits is not None  # capture set it with the graph
        return self.logits


class PrefillRunner:
    """prefill(ids [B, L], last [B]) -> logits [B, V] of each sequence's token at last."""

    max_graph_tokens = 8192

    def __init__(
        self, program: Callable, max_seq: int, device: torch.device, cuda_graphs: bool, buckets: bool | None = None
    ):
        """buckets: pad to length buckets (default: where graphs are captured, i.e. on CUDA with
        cuda_graphs; load's prefill_buckets: True runs the padded path eagerly, as tests do on CPU)."""
        self.program, self.device = program, device
        self.graphs = cuda_graphs and device.type == "cuda"
        self.pad = self.graphs if buckets is None else buckets
        self.buckets = length_buckets(max_seq)
        self.steps: dict[tuple[int, int], PrefillStep] = {}
        self._pool: tuple[int, int] | None = None  # the graphs' memory pool (torch.cuda.graph_pool_handle)
        register_runner(self)

    def bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def padded(self, batch: int, length: int) -> bool:
        """Whether a prefill of this shape runs in a length bucket (on CUDA: a graph)."""
        return self.pad and batch * self.bucket(length) <= self.max_graph_tokens

    def __call__(self, ids: torch.Tensor, last: torch.Tensor, graphs: bool = True) -> torch.Tensor:
        B, L = ids.shape
        Lb = self.bucket(L)
        if not graphs or not self.padded(B, L):
            pos = torch.arange(L, device=self.device).expand(B, L).contiguous()
            return self.program(ids, pos, torch.zeros(B, dtype=torch.long, device=self.device), last)
        step = self.steps.get((B, Lb))
        if step is None:
            step = self.steps[(B, Lb)] = PrefillStep(self.program, B, Lb, self.device)
            if self.graphs:
                step.ids[:, :L].copy_(ids)  # the warm-up runs compute this very prefill
                step.last.copy_(last)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                try:
                    step.capture(self._pool)
                except Exception as e:  # e.g. an op that cannot be captured: say so, run eagerly
                    print(
                        f"dsc: capturing the prefill of {B} x {Lb} tokens failed ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); prefills run eagerly",
                        file=sys.stderr,
                    )
                    self.graphs = self.pad = False
                    del self.steps[(B, Lb)]
                    return self(ids, last)
        return step(ids, last)

    def release(self) -> None:
        """Drop the graphs (before a process group is torn down; see decode.release_cuda_graphs)."""
        for step in self.steps.values():
            if step.graph is not None:
                torch.cuda.synchronize(step.device)
                step.graph.reset()
        self.steps.clear()
        self.graphs = False


class EncodeStep:
    """Static inputs of one (batch, length) shape of an encoder's `encode` program and its graph.
    Rows past the batch get one pad token (length 1); positions past a row's length are keys
    the attention masks, so no real token's state depends on them."""

    def __init__(self, program: Callable, batch: int, length: int, device: torch.device, pad_id: int):
        self.program, self.device, self.pad_id = program, device, pad_id
        self.ids = torch.full((batch, length), pad_id, dtype=torch.long, device=device)
        self.lengths = torch.ones(batch, dtype=torch.long, device=device)
        self.states: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def _forward(self) -> torch.Tensor:
        return self.program(self.ids, self.lengths)

    def capture(self, pool) -> None:
        self.graph, self.states = capture_graph(self._forward, self.device, pool)

    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        B, L = ids.shape
        self.ids.fill_(self.pad_id)
        self.ids[:B, :L].copy_(ids)
        self.lengths.fill_(1)
        self.lengths[:B].copy_(lengths)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.states = self._forward()
        assert self.states is not None  # capture set it with the graph
        return self.states[:B, :L]


class EncodeRunner:
    """encode(ids [B, L], lengths [B]) -> last hidden states [B, L, E]. On CUDA a batch runs in
    the (Bb, Lb) graph: Bb the power of two >= B, Lb the length bucket >= L (as prefill's),
    captured on first use; batches of more than `max_graph_tokens` padded tokens run eagerly.
    The returned tensor is the graph's output buffer: the next call overwrites it."""

    max_graph_tokens = 1 << 16

    def __init__(self, program: Callable, max_seq: int, device: torch.device, cuda_graphs: bool, pad_id: int):
        self.program, self.device, self.pad_id = program, device, pad_id
        self.graphs = cuda_graphs and device.type == "cuda"
        self.buckets = length_buckets(max_seq)
        self.steps: dict[tuple[int, int], EncodeStep] = {}
        self._pool: tuple[int, int] | None = None  # the graphs' memory pool (torch.cuda.graph_pool_handle)
        register_runner(self)

    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        B, L = ids.shape
        Bb, Lb = 1 << max(B - 1, 0).bit_length(), next(b for b in self.buckets if b >= L)
        if not self.graphs or Bb * Lb > self.max_graph_tokens:
            return self.program(ids, lengths)
        step = self.steps.get((Bb, Lb))
        if step is None:
            step = self.steps[(Bb, Lb)] = EncodeStep(self.program, Bb, Lb, self.device, self.pad_id)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                step.capture(self._pool)
            except Exception as e:  # an op that cannot be captured: say so, run eagerly
                print(
                    f"dsc: capturing the encoding of {Bb} x {Lb} tokens failed ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); encodings run eagerly",
                    file=sys.stderr,
                )
                self.graphs = False
                del self.steps[(Bb, Lb)]
                return self.program(ids, lengths)
        return step(ids, lengths)

    release = PrefillRunner.release  # the same steps and graphs to drop
