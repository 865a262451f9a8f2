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
sized for it, not for the artifact's max_batch); `logits_at` takes the logits at several
positions of every sequence from that one run.

With `dtype` (float32), the program computes in that dtype whatever the artifact's: every
16-bit tensor an op reads is cast to it (a linear's weight a block of rows at a time, a
lookup's table not at all: its rows read are), so no whole weight is held twice; the KV cache
is allocated in it, and a floating dtype a node names (a cast) is replaced by it. Simulators
run on several threads may share a `lock`: the nodes that hold every rank's weight at once (a
collective: an embedding's lookup all-reduced), a whole table, or more than SERIAL_BYTES of
weights (an lm_head) run under it, one at a time.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

import dsc.kernels  # noqa: F401  (registers the dsc ops the programs call)
from dsc.kernels.registry import op_name, traits

SERIAL_BYTES = 256 << 20  # a node reading more weight bytes than this per rank runs under `lock`
ROW_BLOCK = 1 << 20  # weight elements per block of a linear computed in `dtype` (a few MB in fp32)
Observer = Callable[[fx.Node, int, tuple], None]  # (node, rank, its evaluated args), before the call
Produce = Callable[[str, int], torch.Tensor]  # (weight name, rank) -> tensor


class Simulator:
    """All ranks of a model's prefill program, in one process.

    `model` needs `.programs` (name -> fx.Graph with get_attr weights and `kv_cache.<i>.k/v`),
    `.kv_cache` ({layers, shape, dtype}), and for the cache decision `.weights` specs (optional)."""

    def __init__(
        self,
        model: Any,
        produce: Produce,
        world: int,
        batch: int,
        seq: int,
        cache_bytes: int = 1 << 30,
        weight_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        lock: threading.Lock | None = None,
    ):
        self.model, self.produce, self.world, self.dtype = model, produce, world, dtype
        self.lock = lock or contextlib.nullcontext()
        self.graphs = dict(model.programs)
        kv = model.kv_cache
        shape = [batch, kv["shape"][1], seq, kv["shape"][3]] if kv else None  # rows x local kv heads x seq x head_dim
        kv_dtype = dtype or (getattr(torch, kv["dtype"]) if kv else None)
        self.caches = [
            {f"kv_cache.{i}.{t}": torch.zeros(shape, dtype=kv_dtype) for i in range(kv["layers"]) for t in ("k", "v")}
            if kv
            else {}
            for _ in range(world)
        ]
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
        nodes = list(self.graphs[program].nodes)
        last_use = {n: i for i, node in enumerate(nodes) for n in node.all_input_nodes}
        ranks = range(self.world)
        env: list[dict[fx.Node, Any]] = [{} for _ in ranks]

        def value(a: fx.Node, r: int):
            if a.op == "get_attr" and a not in env[r]:
                env[r][a] = self._weight(a.target, r)  # produced at first use, not at the graph's top
            return env[r][a]

        args_of = lambda n, r: fx.node.map_arg((n.args, n.kwargs), lambda a: value(a, r))  # noqa: E731
        feed = iter(inputs)

        def free(i: int, node: fx.Node, of_ranks) -> None:  # what nothing reads any more
            for a in node.all_input_nodes:
                if last_use[a] == i:
                    for r in of_ranks:
                        env[r].pop(a, None)

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
                with self.lock:  # every rank's inputs at once
                    per_rank = [self._cast(node, args_of(node, r))[0] for r in ranks]
                    for r, y in zip(ranks, combine(per_rank)):
                        env[r][node] = self._cast_out(node, y)
                    free(i, node, ranks)
            else:  # rank by rank, each rank's inputs freed before the next rank's are made
                with (
                    self.lock if _gathers(node) or self._reads_bytes(node) > SERIAL_BYTES else contextlib.nullcontext()
                ):
                    for r in ranks:
                        env[r][node] = self._call(node, r, args_of(node, r), observe)
                        free(i, node, [r])
            free(i, node, ranks)
        raise RuntimeError(f"program {program} has no output node")

    def prefill(
        self, sequences: Sequence[Sequence[int]], last_idx: Sequence[int] | None = None, observe: Observer | None = None
    ) -> torch.Tensor:
        """Right-padded sequences from position 0 (an empty cache): logits [B, V] fp32 at
        last_idx (default: each sequence's last token)."""
        for c in self.caches:
            for t in c.values():
                t.zero_()
        ids, pos = pad(sequences)
        last = torch.tensor(list(last_idx) if last_idx is not None else [len(s) - 1 for s in sequences])
        return self.run("prefill", (ids, pos, torch.zeros(len(sequences), dtype=torch.long), last), observe).float()

    def _call(self, node: fx.Node, rank: int, args_kwargs: tuple, observe: Observer | None) -> Any:
        args, kwargs = args_kwargs
        if observe is not None:
            observe(node, rank, args)
        bias_arg = _bias_arg(node)
        if self.dtype is None or bias_arg is None:
            args, kwargs = self._cast(node, (args, kwargs))
            return self._cast_out(node, node.target(*args, **kwargs))
        # a linear: output columns a block of weight rows at a time, each block cast as it is
        # used (args 1..bias_arg are indexed by output row), so no whole weight is copied
        n, k = args[1].shape
        rows = max(1, ROW_BLOCK // k)
        outs = []
        for a in range(0, n, rows):
            part = [t[a : a + rows] if 1 <= i <= bias_arg and t is not None else t for i, t in enumerate(args)]
            part, kw = self._cast(node, (part, kwargs))
            outs.append(node.target(*part, **kw))
        return torch.cat(outs, -1) if len(outs) > 1 else outs[0]

    def _reads_bytes(self, node: fx.Node) -> int:
        """Bytes of one rank's weights the node reads, from the model's weight specs (0 without)."""
        from dsc.compiler.weights import local_dtype, local_shape

        specs = getattr(self.model, "weights", {})
        return sum(
            math.prod(local_shape(specs[a.target], self.world)) * local_dtype(specs[a.target]).itemsize
            for a in node.all_input_nodes
            if a.op == "get_attr" and a.target in specs
        )

    def _cast(self, node: fx.Node, args_kwargs: Any) -> Any:
        """(args, kwargs) with every lower-precision float tensor, and every float dtype, made
        self.dtype; a lookup's table (argument 0) stays as it is (its result is cast instead:
        the same values, without a copy of the whole table)."""
        if self.dtype is None:
            return args_kwargs
        args, kwargs = args_kwargs
        if _gathers(node):
            rest, kwargs = fx.node.map_aggregate((tuple(args[1:]), kwargs), self._cast_one)
            return (args[0], *rest), kwargs
        return fx.node.map_aggregate((args, kwargs), self._cast_one)

    def _cast_out(self, node: fx.Node, y: Any) -> Any:
        return fx.node.map_aggregate(y, self._cast_one) if self.dtype is not None and _gathers(node) else y

    def _cast_one(self, a: Any) -> Any:
        if isinstance(a, torch.dtype):
            return self.dtype if a.is_floating_point else a
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype.itemsize < self.dtype.itemsize:
            return a.to(self.dtype)
        return a

    def encoder_states(self, sequences: Sequence[Sequence[int]], pad_token_id: int) -> torch.Tensor:
        """An encoder's last hidden states [n, E] fp32 of every real token of every sequence (in
        order), from one run of the right-padded batch."""
        ids, _ = pad(sequences, pad_token_id)
        lengths = torch.tensor([len(s) for s in sequences])
        h = self.run("encode", (ids, lengths)).float()
        return torch.cat([h[b, :n] for b, n in enumerate(lengths.tolist())])

    def logits_at(
        self, sequences: Sequence[Sequence[int]], positions: int, observe: Observer | None = None
    ) -> torch.Tensor:
        """Logits [n, V] fp32 at the last `positions` positions of every sequence (each of a
        shorter one), sequence by sequence, from one prefill run of the batch: the program's
        `h[arange(B), last_idx]` ([B, S, E] -> [B, E]) is run as `h.flatten(0, 1)[rows]`."""
        if "prefill_rows" not in self.graphs:
            self.graphs["prefill_rows"] = _flat_rows(self.graphs["prefill"])
        L = max(2, max(len(s) for s in sequences))
        rows = [b * L + j for b, s in enumerate(sequences) for j in range(max(0, len(s) - positions), len(s))]
        for c in self.caches:
            for t in c.values():
                t.zero_()
        ids, pos = pad(sequences)
        return self.run(
            "prefill_rows", (ids, pos, torch.zeros(len(sequences), dtype=torch.long), torch.tensor(rows)), observe
        ).float()


def _flat_rows(graph: fx.Graph) -> fx.Graph:
    """A copy of a prefill program whose last input picks rows of the flattened [B * S, E]
    hidden states instead of one position per sequence."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.output(g.graph_copy(graph, env))
    inputs = [n for n in g.nodes if n.op == "placeholder"]
    ids, last = inputs[0], inputs[3]
    for u in list(last.users):  # the batch size read off last_idx (as traced) is input_ids' rows
        if u.target is torch.ops.aten.sym_size.int and u.args[1] == 0:
            u.args = (ids, 0)
    (index,) = [u for u in last.users if u.target is torch.ops.aten.index.Tensor]
    h, (arange, _) = index.args
    with g.inserting_before(index):
        flat = g.call_function(torch.ops.aten.flatten.using_ints, (h, 0, 1))
    index.args = (flat, [last])
    if not arange.users:
        g.erase_node(arange)
    return g


def _gathers(node: fx.Node) -> bool:
    """A table lookup (argument 0 the table: an embedding), as its kernel file declares it."""
    if isinstance(node.target, torch._ops.OpOverload):
        return traits(op_name(node.target)).gather
    return False


def _bias_arg(node: fx.Node) -> int | None:
    """A linear's bias argument index (its weight is argument 1): aten.linear's, or a dsc op's
    as its kernel file declares it; None for other ops."""
    if node.target is torch.ops.aten.linear.default:
        return 2
    if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "dsc":
        return traits(op_name(node.target)).bias_arg
    return None


def _collective(node: fx.Node) -> Callable[[list[tuple]], list] | None:
    """How a collective combines every rank's args into every rank's result, as its kernel file
    declares it (kernels/registry.py `simulate`); None for the ops each rank runs alone."""
    if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "dsc":
        return traits(op_name(node.target)).simulate
    return None


def pad(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids) [B, L], right-padded with pad_id; L >= 2 (the prefill program's minimum)."""
    L = max(2, max(len(s) for s in sequences))
    ids = torch.full((len(sequences), L), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return ids, torch.arange(L).expand(len(sequences), L).contiguous()


def weight_bytes(model: Any) -> int:
    """Bytes of every rank's weights of a compiler Model."""
    from dsc.compiler.weights import local_dtype, local_shape

    world = model.options.tp
    return sum(math.prod(local_shape(s, world)) * local_dtype(s).itemsize * world for s in model.weights.values())
