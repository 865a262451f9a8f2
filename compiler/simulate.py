"""Run a Model's prefill program in the compiler's process, before anything is written: every
tensor-parallel rank in lockstep, on CPU, over weights produced from the checkpoint.

The program is executed node by node, once per rank, with that rank's weights and its own KV
cache; a collective (`dsc.all_reduce` and the ops with one fused in, `dsc.all_gather`) combines
the ranks' inputs, as NCCL would. The int8 pass calibrates SmoothQuant with it and the int8
report compares the quantized program with its unquantized twin; both need the program as it
will run (after sharding and fusion), which the Hugging Face model is not.

Memory stays bounded like the rest of the compiler: a weight is produced when a node first
reads it and dropped after its last reader, unless all of them fit in `cache_bytes` (small
models keep them across runs). Values die after their last use. One run of a batch reads each
weight once, so callers put all their sequences in one batch (the simulator's KV cache is
sized for it, not for the artifact's max_batch).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import dsc.kernels  # noqa: F401  (registers the dsc ops the programs call)
from dsc.kernels.registry import op_name, traits

Observer = Callable[[fx.Node, int, tuple], None]  # (node, rank, its evaluated args), before the call
Produce = Callable[[str, int], torch.Tensor]  # (weight name, rank) -> tensor


class Simulator:
    """All ranks of a model's prefill program, in one process.

    `model` needs `.programs` (name -> fx.Graph with get_attr weights and `kv_cache.<i>.k/v`),
    `.kv_cache` ({layers, shape, dtype}), and for the cache decision `.weights` specs (optional)."""

    def __init__(self, model: Any, produce: Produce, world: int, batch: int, seq: int,
                 cache_bytes: int = 1 << 30, weight_bytes: int | None = None):
        self.model, self.produce, self.world = model, produce, world
        kv = model.kv_cache
        shape = [batch, kv["shape"][1], seq, kv["shape"][3]] if kv else None  # rows x local kv heads x seq x head_dim
        self.caches = [{f"kv_cache.{i}.{t}": torch.zeros(shape, dtype=getattr(torch, kv["dtype"]))
                        for i in range(kv["layers"]) for t in ("k", "v")} if kv else {} for _ in range(world)]
        self.keep = weight_bytes is not None and weight_bytes <= cache_bytes
        self.kept: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]

    def _weight(self, name: str, rank: int) -> torch.Tensor:
        if name in self.caches[rank]:
            return self.caches[rank][name]
        if name in self.kept[rank]:
            return self.kept[rank][name]
        t = self.produce(name, rank)
        if self.keep:
            self.kept[rank][name] = t
        return t

    @torch.inference_mode()
    def run(self, program: str, inputs: Sequence[torch.Tensor], observe: Observer | None = None) -> Any:
        """Rank 0's output of `program` on its inputs."""
        nodes = list(self.model.programs[program].nodes)
        last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
        ranks = range(self.world)
        env: list[dict[fx.Node, Any]] = [{} for _ in ranks]

        def value(a: fx.Node, r: int):
            if a.op == "get_attr" and a not in env[r]:
                env[r][a] = self._weight(a.target, r)  # produced at first use, not at the graph's top
            return env[r][a]

        args_of = lambda n, r: fx.node.map_arg((n.args, n.kwargs), lambda a: value(a, r))  # noqa: E731
        feed = iter(inputs)
        for i, node in enumerate(nodes):
            if node.op == "placeholder":
                x = next(feed)
                for r in ranks:
                    env[r][node] = x
            elif node.op == "get_attr":
                continue
            elif node.op == "output":
                return args_of(node, 0)[0][0]
            elif (combine := _collective(node)) is not None:
                per_rank = [args_of(node, r)[0] for r in ranks]
                for r, y in zip(ranks, combine(per_rank)):
                    env[r][node] = y
            else:
                for r in ranks:
                    args, kwargs = args_of(node, r)
                    if observe is not None:
                        observe(node, r, args)
                    env[r][node] = node.target(*args, **kwargs)
            for a in node.all_input_nodes:  # free what nothing reads any more
                if last_use[a] == i:
                    for r in ranks:
                        env[r].pop(a, None)
        raise RuntimeError(f"program {program} has no output node")

    def prefill(self, sequences: Sequence[Sequence[int]], last_idx: Sequence[int] | None = None,
                observe: Observer | None = None) -> torch.Tensor:
        """Right-padded sequences from position 0 (an empty cache): logits [B, V] fp32 at
        last_idx (default: each sequence's last token)."""
        for c in self.caches:
            for t in c.values():
                t.zero_()
        ids, pos = pad(sequences)
        last = torch.tensor(list(last_idx) if last_idx is not None else [len(s) - 1 for s in sequences])
        return self.run("prefill", (ids, pos, torch.zeros(len(sequences), dtype=torch.long), last), observe).float()


def _collective(node: fx.Node) -> Callable[[list[tuple]], list] | None:
    """How a collective combines every rank's args into every rank's result, as its kernel file
    declares it (kernels/registry.py `simulate`); None for the ops each rank runs alone."""
    if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "dsc":
        return traits(op_name(node.target)).simulate
    return None


def pad(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids) [B, L], right-padded with 0; L >= 2 (the prefill program's minimum)."""
    L = max(2, max(len(s) for s in sequences))
    ids = torch.zeros(len(sequences), L, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return ids, torch.arange(L).expand(len(sequences), L).contiguous()


def weight_bytes(model: Any) -> int:
    """Bytes of every rank's weights of a compiler Model."""
    from dsc.compiler.weights import local_dtype, local_shape

    world = model.options.tp
    return sum(math.prod(local_shape(s, world)) * local_dtype(s).itemsize * world for s in model.weights.values())
