"""The ragged step: T new tokens of N sequences in one flat batch, over a paged KV pool.

The scheduler (runtime/scheduler.py) describes a step as a `Step` of host lists; `pack` turns
it into one int64 tensor (what rank 0 broadcasts under tensor parallelism, and what one
host-to-device copy moves), and `RaggedRunner` runs it:
  - a decode-only step (one token per sequence) runs in the smallest bucket of N sequences
    >= N, over static buffers: padding sequences bring no token (query_lens 0) and padding
    tokens write nothing (slot -1). On CUDA each bucket is a CUDA graph captured at load.
  - a step with prompt chunks (mixed with decode tokens: SplitFuse) runs padded to a token
    bucket and a sequence bucket, on CUDA a graph captured on the shape's first use; beyond
    the largest buckets, eagerly at its exact sizes.
The pool's size is chosen at load from a memory budget (`allocate_kv_pool`).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsc.errors import UserError
from dsc.runtime.decode import capture_graph, choose_bucket, register_runner, reset_graphs

GiB = 1 << 30


def pool_block_bytes(pool: dict) -> int:
    """Bytes of one block in every layer's k and v pools."""
    itemsize = torch.empty((), dtype=getattr(torch, pool["dtype"])).element_size()
    return 2 * pool["layers"] * pool["kv_heads"] * pool["block_size"] * pool["head_dim"] * itemsize


def default_num_blocks(plan: dict) -> int:
    """As many blocks as the static cache's max_batch x max_seq tokens."""
    lim, bs = plan["limits"], plan["kv_pool"]["block_size"]
    return lim["max_batch"] * -(-lim["max_seq"] // bs)


def allocate_kv_pool(
    plan: dict,
    device: torch.device,
    kv_cache_memory: float | None,
    where: Path,
    serving: bool = True,
    layers: list[int] | None = None,
    agree: Callable[[int], int] | None = None,
) -> dict[str, torch.Tensor]:
    """kv_pool.<layer>.k|v [num_blocks, kv_heads, block_size, head_dim]. kv_cache_memory (GiB)
    sizes it; without it: 90% of the free GPU memory for a serving engine on CUDA, else the
    static cache's size (on CPU, and beside the static programs, which hold their own cache).
    layers: the layers this rank holds (a pipeline stage's; default all); agree(num_blocks):
    the count every stage can hold (one block table serves them all)."""
    pool = plan["kv_pool"]
    layers = list(range(pool["layers"])) if layers is None else layers
    per_block = pool_block_bytes(pool) * len(layers) // pool["layers"]
    if kv_cache_memory is not None:
        if (
            isinstance(kv_cache_memory, bool)
            or not isinstance(kv_cache_memory, (int, float))
            or not math.isfinite(kv_cache_memory)
            or kv_cache_memory <= 0
        ):
            raise UserError(f"--kv-cache-memory: expected a positive number of GiB, got {kv_cache_memory!r}")
        num_blocks = int(kv_cache_memory * GiB // per_block)
    elif device.type == "cuda" and serving:
        free, _ = torch.cuda.mem_get_info(device)
        num_blocks = int(0.9 * free // per_block)
    else:
        num_blocks = default_num_blocks(plan)
    if agree is not None:
        num_blocks = agree(num_blocks)
    if num_blocks < 2:
        raise UserError(
            f"--kv-cache-memory: {kv_cache_memory} GiB holds {num_blocks} KV blocks of "
            f"{per_block / 2**20:.3f} MiB; give at least {2 * per_block / 2**20:.3f} MiB"
        )
    shape = (num_blocks, pool["kv_heads"], pool["block_size"], pool["head_dim"])
    dtype = getattr(torch, pool["dtype"])
    try:
        return {f"kv_pool.{i}.{t}": torch.zeros(shape, dtype=dtype, device=device) for i in layers for t in ("k", "v")}
    except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
        raise UserError(
            f"{where}: a KV pool of {num_blocks} blocks ({num_blocks * per_block / GiB:.2f} GiB) does "
            f"not fit on {device}; give a smaller --kv-cache-memory"
        ) from None


@dataclass
class Step:
    """One ragged step, as host lists. Sequence i brings tokens input_ids[query_start[i]:
    query_start[i] + query_lens[i]] at positions cache_lens[i].. (the positions the model sees
    are `positions`); logits are returned for the tokens at logits_idx."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    cache_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logits_idx: list[int] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def pack(step: Step) -> torch.Tensor:
    """[T, N, MB, ids, positions, slots, query_start, query_lens, cache_lens, tables, logits_idx]."""
    T, N = len(step.input_ids), len(step.query_lens)
    MB = max(1, max((len(b) for b in step.block_tables), default=1))
    buf = array("q", (T, N, MB))
    for part in (step.input_ids, step.positions, step.slot_mapping, step.query_start, step.query_lens, step.cache_lens):
        buf.extend(part)
    pad = array("q", bytes(8 * MB))
    for b in step.block_tables:
        buf.extend(b)
        buf.extend(pad[: MB - len(b)])
    buf.extend(step.logits_idx)
    return torch.frombuffer(buf, dtype=torch.long)


_INT32 = (2, 3, 4, 5, 6)  # slots, query_start, query_lens, cache_lens, tables


class GraphStep:
    """Static inputs of a step of up to `t` tokens of up to `n` sequences, and its CUDA graph.
    Padding tokens write nothing (slot -1) and belong to no sequence; padding sequences bring no
    token (query_lens 0) and read logits row 0."""

    def __init__(self, program: Callable, t: int, n: int, max_blocks: int, device: torch.device):
        self.program, self.t, self.n, self.device = program, t, n, device
        self.ids = torch.zeros(1, t, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, t, dtype=torch.long, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int32, device=device)
        self.qs = torch.zeros(n, dtype=torch.int32, device=device)
        self.ql = torch.zeros(n, dtype=torch.int32, device=device)
        self.cl = torch.zeros(n, dtype=torch.int32, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.li = torch.zeros(n, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def _forward(self) -> torch.Tensor:
        return self.program(self.ids, self.pos, self.slots, self.qs, self.ql, self.cl, self.tables, self.li)

    def capture(self, pool) -> None:
        self.graph, self.logits = capture_graph(self._forward, self.device, pool)

    def fill(self, T: int, N: int, MB: int, parts: list[torch.Tensor]) -> None:
        ids, pos, slots, qs, ql, cl, tables, li = parts
        self.ids[0, :T].copy_(ids)
        self.pos[0, :T].copy_(pos)
        self.slots[:T].copy_(slots)
        self.qs[:N].copy_(qs)
        self.ql[:N].copy_(ql)
        self.cl[:N].copy_(cl)
        self.tables[:N, :MB].copy_(tables)
        self.li[:N].copy_(li)
        if T < self.t:
            self.ids[0, T:].zero_()
            self.pos[0, T:].zero_()
            self.slots[T:].fill_(-1)
        if N < self.n:
            self.qs[N:].fill_(T)
            self.ql[N:].zero_()
            self.cl[N:].zero_()
            self.li[N:].zero_()

    def __call__(self, T: int, N: int, MB: int, parts: list[torch.Tensor]) -> torch.Tensor:
        self.fill(T, N, MB, parts)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._forward()
        assert self.logits is not None  # capture set it with the graph
        return self.logits[:N]


MAX_BUCKET = 512  # decode-only steps of more sequences run eagerly: their GPU time dwarfs the launches
MIN_TOKENS, MAX_TOKENS = 64, 2048  # mixed steps: token buckets (powers of two); larger steps run eagerly


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, then steps of 16 to 64, of 32 to 256, of 64 to MAX_BUCKET; the last
    min(max_num_seqs, MAX_BUCKET)."""
    top = min(max_num_seqs, MAX_BUCKET)
    out, b = [], 1
    while b < top:
        out.append(b)
        b = b * 2 if b < 16 else b + (16 if b < 64 else 32 if b < 256 else 64)
    return tuple(out + [top])


class RaggedRunner:
    """runner(packed) -> logits [N, V] of a step `pack` made (on the CPU).

    Decode-only steps run in the smallest decode bucket of sequences >= N; on CUDA those graphs
    are captured at load. Mixed steps (prompt chunks) run padded to a token bucket (a power of
    two from MIN_TOKENS) and a sequence bucket, each (tokens, sequences) shape captured on first
    use, as runtime/prefill.py does; larger steps, and every mixed step where nothing is
    captured (pad=False: the CPU's default), run eagerly at their exact sizes."""

    def __init__(
        self,
        program: Callable,
        pool: dict,
        max_seq: int,
        max_num_seqs: int,
        device: torch.device,
        cuda_graphs: bool,
        pad: bool | None = None,
    ):
        self.program, self.device = program, device
        self.max_blocks = -(-max_seq // pool["block_size"])
        self.buckets = decode_buckets(max_num_seqs)
        self.graphs = cuda_graphs and device.type == "cuda"
        self.pad = self.graphs if pad is None else pad
        self.steps = {(b, b): GraphStep(program, b, b, self.max_blocks, device) for b in self.buckets}
        self.captured = False
        self._pool = None
        self._pinned = device.type == "cuda"
        if self.graphs:
            self._pool = torch.cuda.graph_pool_handle()
            try:
                for b in sorted(self.buckets, reverse=True):  # largest first: smaller ones reuse its pool
                    self.steps[(b, b)].capture(self._pool)
                torch.cuda.synchronize(device)
                self.captured = True
            except Exception as e:  # an op that cannot be captured: say so, run eagerly
                self._give_up(e)
            register_runner(self)

    def _give_up(self, e: Exception) -> None:
        print(
            f"dsc: capturing a ragged step failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); steps run eagerly",
            file=sys.stderr,
        )
        self.release()
        self.graphs = self.pad = False

    def release(self) -> None:
        reset_graphs(self.steps.values())
        self.captured = False

    def warm_up(self, max_tokens: int) -> None:
        """Capture the mixed steps of up to max_tokens tokens (a scheduler's budget) at every
        sequence bucket now, so that no step of a run pays for a capture."""
        if self.graphs:
            for n in self.buckets:
                self._mixed_step(min(max_tokens, MAX_TOKENS), n)
            torch.cuda.synchronize(self.device)

    def _mixed_step(self, T: int, N: int) -> GraphStep | None:
        if not self.pad or T > MAX_TOKENS or N > self.buckets[-1]:
            return None
        tb = max(MIN_TOKENS, 1 << (T - 1).bit_length())
        nb = choose_bucket(self.buckets, N)
        step = self.steps.get((tb, nb))
        if step is None:
            step = self.steps[(tb, nb)] = GraphStep(self.program, tb, nb, self.max_blocks, self.device)
            if self.graphs:
                try:
                    step.capture(self._pool)
                except Exception as e:  # noqa: BLE001
                    self._give_up(e)
                    return None
        return step

    def __call__(
        self,
        packed: torch.Tensor,
        prev: torch.Tensor | None = None,
        upload: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """packed: a step from `pack`, on the host. An input id -(r + 1) is the token at row r of
        prev (the previous step's sampled tokens, on the device), gathered there. upload moves
        the packed step to the device (default: through a pinned copy)."""
        dev = (
            upload(packed)
            if upload is not None
            else packed.pin_memory().to(self.device, non_blocking=True)
            if self._pinned
            else packed
        )
        T, N, MB, parts = unpack_sizes(packed, dev)
        if prev is not None:  # ids [T]: pending inputs taken from the device
            ids = parts[0]
            parts[0] = torch.where(ids < 0, prev.index_select(0, (-ids - 1).clamp_(0, prev.numel() - 1)), ids)
        if MB <= self.max_blocks:
            if T == N and N <= self.buckets[-1]:
                b = choose_bucket(self.buckets, N)
                return self.steps[(b, b)](T, N, MB, parts)
            step = self._mixed_step(T, N)
            if step is not None:
                return step(T, N, MB, parts)
        parts = [p.to(torch.int32) if i in _INT32 else p for i, p in enumerate(parts)]
        ids, pos, *rest = parts
        return self.program(ids[None], pos[None], *rest)


def unpack_sizes(host: torch.Tensor, dev: torch.Tensor) -> tuple[int, int, int, list[torch.Tensor]]:
    """The sizes read from the host copy, the parts sliced from the device copy."""
    T, N, MB = (int(x) for x in host[:3].tolist())
    sizes = [T, T, T, N, N, N, N * MB, N]
    parts = list(dev[3 : 3 + sum(sizes)].split(sizes))
    parts[6] = parts[6].view(N, MB)
    return T, N, MB, parts
