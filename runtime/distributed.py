"""Process-group set-up for tensor-parallel runs: NCCL on GPU, gloo on CPU."""
from __future__ import annotations

import atexit

import torch
import torch.distributed as dist


def _destroy_process_group() -> None:
    # a rank that exits with the group still alive can abort in gloo/NCCL's background threads
    # ("terminate called without an active exception"): tear it down explicitly
    if dist.is_initialized():
        dist.destroy_process_group()


def shutdown_process_group() -> None:
    """End a tensor-parallel run: wait until every rank is done, then tear the group down."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def ensure_process_group(device: torch.device, world: int, rank: int) -> None:
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", world_size=world, rank=rank, device_id=device)
    else:
        dist.init_process_group("gloo", world_size=world, rank=rank)
    atexit.register(_destroy_process_group)
