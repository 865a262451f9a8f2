"""`dsc::all_reduce`: the tensor-parallel sum after a row-parallel linear.

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
