"""Tensor-parallel collectives: `dsc::all_reduce` (the sum after a row-parallel linear) and
`dsc::all_gather` (vocab-parallel logits -> full logits on every rank).

The op runs torch's functional collective on the default process group, so a decode step
that contains it can be captured in a CUDA graph (NCCL) and runs on CPU under gloo. Outside
a distributed run (world size 1) it is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


@torch.library.custom_op("dsc::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return x.clone()
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
