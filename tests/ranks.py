"""Run a function on every rank of a CPU tensor-parallel group, for tests.

`spawn_ranks(world, work, jobs)` starts `world` spawned processes joined by a gloo file store,
calls `work(rank, jobs)` in each (a module-level function, so it pickles) and returns
{rank: its result}. A rank that raises fails the test with every rank's error. Processes use
one thread each; the group is torn down after a final barrier (see runtime/distributed.py).
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from dsc.runtime.distributed import shutdown_process_group

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _entry(rank: int, world: int, store: str, work: Callable, jobs: Any, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        # pickled here, by value: torch.multiprocessing's queue would send a tensor as a handle
        # to this process's shared memory, which the parent opens through this process, which
        # may have exited by then (FileNotFoundError in the parent: a flaky test on a busy box)
        queue.put((rank, pickle.dumps(work(rank, jobs))))
    except BaseException as e:
        queue.put((rank, RuntimeError(f"rank {rank}: {type(e).__name__}: {e}")))
        shutdown_process_group(barrier=False)
        raise
    shutdown_process_group()


def spawn_ranks(world: int, work: Callable, jobs: Any, timeout: float = 300) -> dict[int, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # inherited by the children
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_entry, args=(r, world, f"{d}/store", work, jobs, queue)) for r in range(world)]
        try:
            for p in procs:
                p.start()
            results = {
                r: pickle.loads(v) if isinstance(v, bytes) else v
                for r, v in (queue.get(timeout=timeout) for _ in range(world))
            }
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    bad = {r: str(v) for r, v in results.items() if isinstance(v, BaseException)}
    assert not bad, bad
    return results
