"""Process-group set-up for tensor-parallel runs: NCCL on GPU, gloo on CPU."""
from __future__ import annotations

import torch
import torch.distributed as dist


def ensure_process_group(device: torch.device, world: int, rank: int) -> None:
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", world_size=world, rank=rank, device_id=device)
    else:
        dist.init_process_group("gloo", world_size=world, rank=rank)
