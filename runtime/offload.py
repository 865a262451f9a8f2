"""Weights beyond a device budget, streamed to the device layer by layer (ZeRO-Inference's
parameter offload), a load-time choice over the same artifact:

    engine = load(art, offload="cpu", gpu_memory=6)     # dsc serve ART --offload cpu --gpu-memory 6

`plan_offload` (no torch: `dsc inspect --gpu-memory` uses it) splits a rank file's tensors into
what stays on the device — every tensor outside the numbered layers (embeddings, final norm,
head), then whole layers in order while the budget lasts — and the layers that are streamed. Those
live in host memory (`cpu`: pinned, read from the rank file once at load) or stay in the rank
file (`disk`: read again at every use, into pinned staging buffers). The device holds a ring of
`slots` layer buffers; `WeightRing` fills them on a copy stream while the compute stream runs
the layer before (prefetching the next `slots - 1` layers in the programs' order, wrapping round
to the first at the end of a step), and a buffer is refilled only after the compute that read
it (its events). `stream_weights` rewrites a program's graph so each streamed weight is taken
from the ring just before its first use and its layer's buffer is given back after its last.

The stream runs eagerly (no CUDA graphs: the copies follow the host's order of layers), and a
step moves every streamed layer's bytes once: throughput comes from large batches, which the
ragged program's continuous batching supplies.
"""

from __future__ import annotations

import math
import operator
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from dsc.errors import UserError

WHERE = ("cpu", "disk")
SLOTS = 3  # layer buffers on the device: the one computing and the next two in flight
ALIGN = 256  # byte alignment of each tensor in a layer buffer (the kernels' 16-byte loads and more)
READ_CHUNK = 16 << 20  # a layer's read is cut into pieces of at most this many bytes ...
READERS = 8  # ... that this many threads read at once (one thread's copies out of the page cache,
# or one request in flight to an NVMe drive, are a fraction of what the host can read)
_LAYER = re.compile(r"^(?P<unit>.+?\.(?P<index>\d+))\.")


def check_offload(offload: str | None, gpu_memory: float | None) -> None:
    """--offload and --gpu-memory as one UserError line naming the flag."""
    if offload is not None and offload not in WHERE:
        raise UserError(f"--offload: expected one of {', '.join(WHERE)}, got {str(offload)[:40]!r}")
    if gpu_memory is None:
        return
    if isinstance(gpu_memory, bool) or not isinstance(gpu_memory, (int, float)) or not 0 < gpu_memory < 1 << 20:
        raise UserError(f"--gpu-memory: expected GiB > 0, got {gpu_memory!r}")
    if offload is None:
        raise UserError("--gpu-memory: a weight budget needs --offload cpu or --offload disk (where the rest lives)")


def layer_of(name: str) -> str | None:
    """The numbered layer a tensor belongs to (`model.layers.3` of `model.layers.3.mlp.up_proj.weight`,
    `transformer.h.3` of GPT-2's), or None outside the layers."""
    m = _LAYER.match(name)
    return m["unit"] if m else None


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    file_offset: int  # in the rank file
    nbytes: int
    slot_offset: int  # in a layer buffer


@dataclass(frozen=True)
class Layer:
    name: str
    tensors: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Placement:
    """Where a rank's weights live: `resident` on the device, `streamed` layers through `slots`
    buffers of `slot_bytes` each."""

    budget: int | None
    resident: tuple[str, ...]
    resident_bytes: int
    streamed: tuple[Layer, ...]
    slots: int
    slot_bytes: int
    layers: int = 0  # numbered layers in all
    where: str = "cpu"

    @property
    def streamed_bytes(self) -> int:
        """Bytes one forward step moves to the device (each streamed layer once)."""
        return sum(layer.nbytes for layer in self.streamed)

    @property
    def device_bytes(self) -> int:
        return self.resident_bytes + self.slots * self.slot_bytes

    def summary(self) -> dict:
        return {
            "where": self.where,
            "budget_bytes": self.budget,
            "device_bytes": self.device_bytes,
            "resident_bytes": self.resident_bytes,
            "resident_layers": self.layers - len(self.streamed),
            "streamed_layers": len(self.streamed),
            "layers": self.layers,
            ("host_bytes" if self.where == "cpu" else "disk_bytes"): self.streamed_bytes,
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "bytes_per_step": self.streamed_bytes,
        }


def gib(n: int, up: bool = False) -> str:
    """Bytes in GiB, to 3 significant digits (rounded up with `up`: a minimum to give)."""
    x = n / 2**30
    if up and x > 0:
        step = 10 ** (math.floor(math.log10(x)) - 2)
        x = math.ceil(x / step - 1e-9) * step
    return f"{x:.3g} GiB"


def offload_line(summary: dict) -> str:
    """A placement's summary in one line: what lives on the device, what is streamed from where."""
    on = (
        f"weights: {gib(summary['resident_bytes'])} on the device ({summary['resident_layers']} of "
        f"{summary['layers']} layers and those outside them)"
    )
    if not summary["streamed_layers"]:
        return on + "; none streamed"
    src = "pinned host memory" if summary["where"] == "cpu" else "the rank file"
    return (
        on + f", {summary['slots']} layer buffers of {gib(summary['slot_bytes'])}; "
        f"{summary['streamed_layers']} layers ({gib(summary['bytes_per_step'])}) streamed from {src}, "
        f"{gib(summary['bytes_per_step'])} moved per step"
    )


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_offload(
    header: dict, data_start: int, budget: int | None, where: str = "cpu", slots: int = SLOTS, path: str = "rank file"
) -> Placement:
    """Split a (checked) safetensors header's tensors by a device budget in bytes (None: stream
    every layer). Raises UserError naming --gpu-memory when the budget cannot hold what must
    stay on the device plus the layer buffers."""
    if where not in WHERE:
        raise UserError(f"--offload: expected one of {', '.join(WHERE)}, got {where!r}")
    if slots < 2:
        raise ValueError(f"offload: {slots} layer buffers; the stream needs at least 2")
    layers: dict[tuple[str, int], list[tuple[str, dict]]] = {}
    resident: list[str] = []
    resident_bytes = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        m = _LAYER.match(name)
        if m is None:
            resident.append(name)
            lo, hi = info["data_offsets"]
            resident_bytes += hi - lo
        else:
            prefix = m["unit"][: -len(m["index"])]
            layers.setdefault((prefix, int(m["index"])), []).append((name, info))
    order = sorted(layers)  # by container, then numerically: the programs' order
    units = []
    for key in order:
        tensors, off = [], 0
        for name, info in sorted(layers[key]):
            lo, hi = info["data_offsets"]
            tensors.append(Tensor(name, info["dtype"], tuple(info["shape"]), data_start + lo, hi - lo, off))
            off = _aligned(off + hi - lo)
        units.append(Layer(f"{key[0]}{key[1]}", tuple(tensors)))
    total = resident_bytes + sum(u.nbytes for u in units)
    if (budget is not None and total <= budget) or (budget is None and len(units) <= slots):
        return Placement(
            budget, tuple(resident + [t.name for u in units for t in u.tensors]), total, (), 0, 0, len(units), where
        )
    if len(units) <= slots:  # its buffers would hold every layer: streaming saves nothing
        assert budget is not None  # without a budget, this few layers returned above
        raise UserError(
            f"--gpu-memory: {gib(budget)} is below the weights' {gib(total)}, and {path} has {len(units)} "
            f"numbered layers, no more than the {slots} layer buffers streaming needs; give at least "
            f"{gib(total, up=True)}"
        )
    slots = min(slots, len(units))
    slot_bytes = max(_aligned(u.tensors[-1].slot_offset + u.tensors[-1].nbytes) for u in units)
    floor = resident_bytes + slots * slot_bytes
    keep = 0
    if budget is not None:
        if budget < floor:
            raise UserError(
                f"--gpu-memory: {gib(budget)} cannot hold the weights outside the layers "
                f"({gib(resident_bytes)}) and {slots} layer buffers ({gib(slots * slot_bytes)}); "
                f"give at least {gib(floor, up=True)}"
            )
        room = budget - floor
        while keep < len(units) - slots and units[keep].nbytes <= room:
            room -= units[keep].nbytes
            keep += 1
    kept = units[:keep]
    return Placement(
        budget,
        tuple(resident + [t.name for u in kept for t in u.tensors]),
        resident_bytes + sum(u.nbytes for u in kept),
        tuple(units[keep:]),
        slots,
        slot_bytes,
        len(units),
        where,
    )


def data_start(path: Path) -> int:
    """Where a safetensors file's tensor bytes begin (its header length + 8)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _pread_into(fd: int, buf, offset: int, path: Path) -> None:
    """Fill memoryview `buf` from the file at `offset` (several reads where one returns short)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise UserError(f"{path}: truncated (a streamed layer's bytes end past the file)")
        done += n


class WeightRing:
    """The device's layer buffers and the copies that fill them (module docstring)."""

    # the graph-call targets stream_weights inserts (set below the class: _fetch and _release)
    fetch_node: ClassVar[Callable[..., Any]]
    release_node: ClassVar[Callable[..., Any]]

    def __init__(self, placement: Placement, path: Path, device):
        import torch

        from dsc.runtime.artifact import PLAN_DTYPES

        self.torch, self.placement, self.path, self.device = torch, placement, Path(path), device
        self.where = placement.where
        self.layers = placement.streamed
        self.cuda = device.type == "cuda"
        self.n = placement.slots
        to_torch = {v: getattr(torch, k) for k, v in PLAN_DTYPES.items()}
        self._dtypes = [[to_torch[t.dtype] for t in u.tensors] for u in self.layers]
        self.slots = [torch.empty(placement.slot_bytes, dtype=torch.uint8, device=device) for _ in range(self.n)]
        self.holds: list[int | None] = [None] * self.n  # the layer each buffer holds (or is being filled with)
        self.busy = [False] * self.n  # taken by the compute between acquire and release
        self.ready: list = [None] * self.n  # a copy's event (or the read's Future) to wait for before use
        self.freed: list = [None] * self.n  # the event of the last compute that read the buffer
        self._views: dict[tuple[int, int], list] = {}  # (buffer, layer) -> the layer's tensors there
        self.names = frozenset(t.name for u in self.layers for t in u.tensors)
        self.bytes_moved = self.loads = 0
        self._fd = os.open(self.path, os.O_RDONLY)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.host: list = []
        self._pool: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = ThreadPoolExecutor(
            min(READERS, os.cpu_count() or 1), thread_name_prefix="dsc-offload-read"
        )
        if self.where == "cpu":  # every streamed layer in host memory, laid out as in a buffer
            for u in self.layers:
                buf = torch.empty(placement.slot_bytes, dtype=torch.uint8, pin_memory=self.cuda)
                self._read(u, buf)
                self.host.append(buf)
        else:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsc-offload")
            self._staging = (
                [torch.empty(placement.slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                if self.cuda
                else []
            )
            self._staged: list = [None] * len(self._staging)
            self._next_stage = 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # -- what the rewritten graphs call ------------------------------------------------------
    def fetch(self, layer: int, tensor: int):
        """Streamed layer `layer`'s tensor number `tensor`, in its device buffer."""
        s = self._acquire(layer)
        views = self._views.get((s, layer))
        if views is None:
            buf, u = self.slots[s], self.layers[layer]
            views = self._views[(s, layer)] = [
                buf[t.slot_offset : t.slot_offset + t.nbytes].view(dt).view(t.shape)
                for t, dt in zip(u.tensors, self._dtypes[layer])
            ]
        return views[tensor]

    def release(self, layer: int) -> None:
        """The compute queued so far is the last to read `layer`'s buffer until it is acquired again."""
        s = self._slot_of(layer)
        if s is None or not self.busy[s]:
            return
        self.busy[s] = False
        if self.cuda:
            ev = self.torch.cuda.Event()
            ev.record(self.torch.cuda.current_stream(self.device))
            self.freed[s] = ev

    # -- the ring -------------------------------------------------------------------------------
    def _slot_of(self, layer: int) -> int | None:
        for s, held in enumerate(self.holds):
            if held == layer:
                return s
        return None

    def _acquire(self, layer: int) -> int:
        s = self._slot_of(layer)
        if s is not None and self.busy[s]:
            return s
        if s is None:  # not prefetched: the first step, or a program that ran its layers in another order
            s = self._free_slot(layer, 0)
            if s is None:
                raise RuntimeError(f"offload: every layer buffer is in use when {self.layers[layer].name} is needed")
            self._load(layer, s)
        self._wait(s)
        self.busy[s] = True
        for k in range(1, self.n):  # the next layers, wrapping round to the next step's first
            nxt = (layer + k) % len(self.layers)
            if self._slot_of(nxt) is None:
                t = self._free_slot(layer, k)
                if t is None:
                    break
                self._load(nxt, t)
        return s

    def _free_slot(self, layer: int, k: int) -> int | None:
        """A buffer no compute holds whose layer is needed later than the one `k` after `layer`
        (the latest-needed such buffer), or None."""
        best, best_d = None, k
        for s in range(self.n):
            if self.busy[s]:
                continue
            held = self.holds[s]
            d = len(self.layers) if held is None else (held - layer) % len(self.layers)
            if d > best_d:
                best, best_d = s, d
        return best

    def _load(self, layer: int, s: int) -> None:
        self.holds[s] = layer
        self.loads += 1
        self.bytes_moved += self.layers[layer].nbytes
        freed, self.freed[s] = self.freed[s], None
        if self.where == "cpu":
            self.ready[s] = self._copy(self.host[layer], self.slots[s], freed)
            return
        assert self._pool is not None  # made at init for a ring that streams from disk
        if self.cuda:
            self.ready[s] = self._pool.submit(self._stage, layer, s, freed)
        else:  # the CPU's buffers: read straight into the (released, hence idle) buffer
            self.ready[s] = self._pool.submit(self._read, self.layers[layer], self.slots[s])

    def _copy(self, src, dst, freed):
        """src -> dst on the copy stream once `freed` (the compute that last read dst) is done;
        returns the copy's event (None on the CPU, where the copy is done on return)."""
        torch = self.torch
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            if freed is not None:
                self.copy_stream.wait_event(freed)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        return ev

    def _stage(self, layer: int, s: int, freed):
        """On the reader thread: the layer's bytes from the rank file into a pinned staging
        buffer (once the copy that last read it is done), then onto the device."""
        k = self._next_stage
        self._next_stage = (k + 1) % len(self._staging)
        if self._staged[k] is not None:
            self._staged[k].synchronize()
        self._read(self.layers[layer], self._staging[k])
        ev = self._staged[k] = self._copy(self._staging[k], self.slots[s], freed)
        return ev

    def _read(self, u: Layer, buf) -> None:
        """The layer's tensors from the rank file into `buf` (its buffer layout), in pieces of at
        most READ_CHUNK bytes read by the reader threads at once."""
        readers = self._readers
        if readers is None:
            raise RuntimeError("offload: the weight ring is closed")
        view = memoryview(buf.numpy())
        pieces = [
            (t.slot_offset + o, t.file_offset + o, min(READ_CHUNK, t.nbytes - o))
            for t in u.tensors
            for o in range(0, t.nbytes, READ_CHUNK)
        ]
        reads = [readers.submit(_pread_into, self._fd, view[at : at + n], off, self.path) for at, off, n in pieces]
        for r in reads:
            r.result()

    def _wait(self, s: int) -> None:
        r = self.ready[s]
        if isinstance(r, Future):
            r = self.ready[s] = r.result()
        if r is not None:
            self.torch.cuda.current_stream(self.device).wait_event(r)
            self.ready[s] = None


def _aliases(node) -> bool:
    """Whether a node's output may be a view of its input (a weight's lifetime extends through it)."""
    import torch

    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if isinstance(node.target, torch._ops.OpOverload) and schema is not None:
        return any(r.alias_info is not None for r in schema.returns)
    return False


def stream_weights(graph, ring: WeightRing, ring_attr: str = "_weight_ring") -> int:
    """Rewrite `graph` so each streamed weight (a get_attr of a name the ring streams) is fetched
    from the ring before its first use, and each layer released after its last use (through
    views). Returns the number of weights rewritten. Programs fetch layers in `ring`'s order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    where = {t.name: (li, ti) for li, u in enumerate(ring.layers) for ti, t in enumerate(u.tensors)}
    targets = [n for n in graph.nodes if n.op == "get_attr" and n.target in where]
    if not targets:
        return 0
    first = min(targets, key=lambda n: order[n])
    with graph.inserting_before(first):
        ring_node = graph.get_attr(ring_attr)
    last: dict[int, object] = {}
    for n in targets:
        li, ti = where[n.target]
        users = sorted(n.users, key=lambda u: order[u])
        with graph.inserting_before(users[0] if users else n):
            fetched = graph.call_function(ring.fetch_node, (ring_node, li, ti))
        n.replace_all_uses_with(fetched)
        graph.erase_node(n)
        reach, todo = [], [fetched]
        while todo:  # the fetch and every view of it
            x = todo.pop()
            reach.append(x)
            todo += [u for u in x.users if _aliases(u)]
        end = max((u for x in reach for u in list(x.users) + [x]), key=lambda u: order.get(u, -1))
        if li not in last or order.get(end, -1) > order.get(last[li], -1):
            last[li] = end
    for li, end in last.items():
        with graph.inserting_after(end):
            graph.call_function(ring.release_node, (ring_node, li))
    graph.lint()
    return len(targets)


def _fetch(ring: WeightRing, layer: int, tensor: int):
    return ring.fetch(layer, tensor)


def _release(ring: WeightRing, layer: int) -> None:
    ring.release(layer)


WeightRing.fetch_node = staticmethod(_fetch)
WeightRing.release_node = staticmethod(_release)
