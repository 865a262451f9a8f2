"""Process-group set-up for tensor-parallel runs: NCCL on GPU, gloo on CPU."""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (before any process group exists: see below)
import torch.distributed as dist

# torch._dynamo is imported here, before a process group is created, on purpose: imported
# after (the first call of any torch.library.custom_op imports it), it keeps a reference to the
# default group that destroy_process_group does not drop (torch 2.13), so the gloo threads
# outlive the group and a finished rank can abort at interpreter exit ("terminate called
# without an active exception", exit -6). Every dsc path that starts a group imports this
# module first.
#
# The rendezvous store of a group this module started. Under torchrun the agent hosts the store
# and every rank is a client. Under any other launcher that sets MASTER_ADDR/MASTER_PORT, rank 0
# hosts it: torch's env:// rendezvous would make that a process-wide multi-tenant daemon that
# lives until C++ static destruction at exit. Creating the store here instead lets
# shutdown_process_group stop it, after every rank has passed the final barrier.
_store: dist.Store | None = None


def comm_device() -> torch.device:
    """Where the process group's tensors live: the current GPU under NCCL, else the host."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown_process_group(barrier: bool = True) -> None:
    """End a tensor-parallel run: wait until every rank is done, then tear the group down.

    A rank that exits with the group alive, or tears it down while a peer still talks to it, can
    abort in gloo's or NCCL's background threads. Pass barrier=False on an error path, where
    the other ranks may be inside a different collective and a barrier would pair with it."""
    global _store
    if dist.is_initialized():
        from dsc.kernels import collectives
        from dsc.runtime.decode import release_cuda_graphs

        release_cuda_graphs()  # before the group: graphs hold NCCL's communicator
        collectives.disable_symmetric()
        if barrier:
            try:
                dist.barrier()
            except Exception:  # a peer already died: its error is the one to report, not ours
                pass
        dist.destroy_process_group()
    _store = None


def _rendezvous_store(world: int, rank: int) -> dist.Store | None:
    """A TCPStore for MASTER_ADDR:MASTER_PORT that this module owns, or None to let torch's
    env:// rendezvous decide (under torchrun's agent store, or without MASTER_* set)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return dist.TCPStore(addr, int(port), world, is_master=rank == 0, timeout=timedelta(minutes=10))


def ensure_process_group(device: torch.device, world: int, rank: int) -> None:
    global _store
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _store = _rendezvous_store(world, rank)
    kwargs: dict[str, Any] = {"store": _store} if _store is not None else {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, world_size=world, rank=rank, **kwargs)
    atexit.register(shutdown_process_group)
