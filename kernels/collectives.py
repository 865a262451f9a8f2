"""Tensor-parallel collectives: `dsc::all_reduce` (the sum after a row-parallel linear) and
`dsc::all_gather` (vocab-parallel logits -> full logits on every rank).

The op runs torch's functional collective on the default process group, so a decode step
that contains it can be captured in a CUDA graph (NCCL) and runs on CPU under gloo. Outside
a distributed run (world size 1) it is the identity.

On CUDA the runtime can also enable a one-shot all-reduce through torch's symmetric memory
(`enable_symmetric`): every rank copies its tensor into a buffer its peers can read over
NVLink, all ranks meet at a barrier on device-side signal pads, and each rank sums all the
buffers itself. One launch of a few microseconds, where NCCL at decode sizes (a few KiB to
half a MiB) costs a clone plus a ring all-reduce; a batch-1 decode step of a 32-layer Llama
does 65 of them. Tensors larger than the buffers, other dtypes, and every call outside a
program scope (`program_scope`) take NCCL.

Buffer reuse. The one-shot kernel has a barrier after its copy and none after its sum, so a
rank may start copying its next input while a slower peer still reads its previous one. Two
consecutive one-shot all-reduces therefore never use the same buffer: within a program they
alternate between buffers 0 and 1, and a program with an odd count ends on buffer 2, so the
last all-reduce of any program and the first of the next (always buffer 0) differ as well.
A rank that has passed all-reduce k+1's barrier knows that every peer has finished reading
all-reduce k, so buffer k's owner may overwrite it at k+2. CUDA-graph replays repeat the
captured program's choice, which keeps the same order. An NCCL all-reduce in between is a
synchronisation point of its own.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
import torch.distributed as dist

ALLREDUCE_MODES = ("auto", "nccl")


class _Symmetric:
    """Three rendezvoused symmetric-memory buffers of `numel` elements of `dtype`."""

    def __init__(self, device: torch.device, dtype: torch.dtype, numel: int):
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.9
        if enable is not None:
            with warnings.catch_warnings():  # deprecated (a no-op) in newer torch
                warnings.simplefilter("ignore", FutureWarning)
                enable(group)
        self.group, self.dtype, self.numel = group, dtype, numel
        self.buffers = []
        for _ in range(3):
            buf = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, group)
            self.buffers.append(buf)
        self.count = 0  # all-reduces in the current program scope (0: none open)
        self.index = 0  # the next one's position
        # one real all-reduce of this dtype now: an unsupported dtype or a broken peer mapping
        # fails here, where every rank can still fall back to NCCL, not inside a decode step
        # (the NCCL all-reduce after it in enable_symmetric orders it before any later use)
        ones = torch.ones(min(8, numel), dtype=dtype, device=device)
        got = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffers[0][: ones.numel()], ones, "sum", group)
        if not torch.equal(got, torch.full_like(ones, dist.get_world_size())):
            raise RuntimeError(f"a probe all-reduce of ones over {dist.get_world_size()} ranks gave {got.tolist()}")

    def slot(self) -> int:
        i, self.index = self.index, self.index + 1
        return 2 if i == self.count - 1 and self.count % 2 == 1 else i % 2


_symm: _Symmetric | None = None
_retired: list[_Symmetric] = []  # replaced states: graphs captured with their buffers may still replay


def allreduce_mode() -> str:
    mode = os.environ.get("DSC_ALLREDUCE", "auto")
    if mode not in ALLREDUCE_MODES:
        raise ValueError(f"DSC_ALLREDUCE must be one of {', '.join(ALLREDUCE_MODES)}, got {mode!r}")
    return mode


def enable_symmetric(device: torch.device, dtype: torch.dtype, numel: int) -> str:
    """Collective: every rank calls it with the same arguments, before any CUDA graph capture.
    Returns "symm_mem" when the one-shot path is on for all ranks, else "nccl" (with the reason
    on stderr from rank 0). DSC_ALLREDUCE=nccl keeps NCCL everywhere."""
    global _symm
    if device.type != "cuda" or not dist.is_initialized() or dist.get_world_size() == 1:
        return "nccl"
    if allreduce_mode() == "nccl":
        return "nccl"
    s = _symm
    if s is not None and s.buffers[0].device == device and s.dtype == dtype and s.numel >= numel:
        return "symm_mem"  # a second engine in this process: the same buffers serve it
    if s is not None:
        _retired.append(s)
        _symm = None
    err = ""
    state = None
    try:
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
            raise RuntimeError(f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy")
        state = _Symmetric(device, dtype, numel)
    except Exception as e:  # noqa: BLE001  (any failure: fall back, the same way on every rank)
        err = f"{type(e).__name__}: {e}".splitlines()[0]
    ok = torch.tensor([0 if err else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if int(ok.item()) == 1:
        _symm = state
        return "symm_mem"
    if dist.get_rank() == 0:
        print(f"dsc: one-shot all-reduce unavailable ({err or 'on another rank'}); using NCCL", file=sys.stderr)
    return "nccl"


def disable_symmetric() -> None:
    """Drop the buffers (at shutdown, after the CUDA graphs that use them are destroyed)."""
    global _symm
    _symm = None
    _retired.clear()


@contextlib.contextmanager
def program_scope(all_reduces: int):
    """Run one program's `all_reduces` dsc.all_reduce calls with the buffer order above. With
    fewer than two, a program has no partner to alternate with and uses NCCL."""
    s = _symm
    if s is None:
        yield
        return
    s.count, s.index = (all_reduces if all_reduces >= 2 else 0), 0
    try:
        yield
    finally:
        s.count, s.index = 0, 0


def _one_shot(x: torch.Tensor) -> torch.Tensor | None:
    s = _symm
    if s is None or s.count == 0 or not x.is_cuda:
        return None
    slot = s.slot()  # counted even when this call takes NCCL, which synchronises on its own
    if x.dtype != s.dtype or x.numel() > s.numel:
        return None
    buf = s.buffers[slot][: x.numel()].view(x.shape)
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x.contiguous(), "sum", s.group)


@torch.library.custom_op("dsc::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return x.clone()
    out = _one_shot(x)
    if out is not None:
        return out
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))


@all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("dsc::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order). `world` is the tp size the plan
    was compiled for; it fixes the output shape at compile time."""
    if not dist.is_available() or not dist.is_initialized():
        if world != 1:
            raise RuntimeError(f"dsc.all_gather over {world} ranks needs an initialised process group")
        return x.clone()
    if dist.get_world_size() != world:
        raise RuntimeError(f"dsc.all_gather compiled for {world} ranks, process group has {dist.get_world_size()}")
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch < 2.12
    g = funcol.wait_tensor(gather(x.contiguous(), 0, dist.group.WORLD))  # [world * x.shape[0], ...]
    return torch.cat(g.chunk(world, 0), dim)


@all_gather.register_fake
def _(x, dim, world):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)
