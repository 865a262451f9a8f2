"""fold_position_tables: values computed from positions alone -> a table lookup.

Matches the subgraph that depends on nothing but `position_ids` and constants (the rotary
embedding's inv_freq * position, cat, cos, sin, casts; with scaled RoPE variants their factors)
and whose results other nodes read: each such result v [batch, seq, ...] is a function of the
position alone, so the compiler evaluates the subgraph once for positions 0..max_seq-1 and
rewrites v as table[position_ids] (aten.index.Tensor on a constant `<v>.table` [max_seq, ...]).
Counted under `fold_position_tables.table`. A decode step then runs one gather per table (2 for
RoPE's cos and sin) instead of the ~7 small kernels of the original chain.
Checked at compile time: the tables must reproduce the original subgraph exactly on positions
drawn at random (a subgraph that mixes positions is left alone).
Requires: canonicalize. Guarantees: same values bit for bit (the tables are computed by the
same ops on the CPU); table bytes = max_seq x (row bytes) per table, in every rank's file.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dsc.compiler.ir import Model, WeightSpec
from dsc.compiler.serialize import stable_names
from dsc.passes._util import arg_node, aten, attr_name, call_target

_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}
_RANDOM = {aten.rand.default, aten.randn.default, aten.randint.low, aten.bernoulli.default}


def _nodes_in(a: Any) -> list[fx.Node]:
    if isinstance(a, fx.Node):
        return [a]
    if isinstance(a, (list, tuple)):
        return [m for x in a for m in _nodes_in(x)]
    if isinstance(a, dict):
        return [m for x in a.values() for m in _nodes_in(x)]
    return []


def _position_only(graph: fx.Graph, pos: fx.Node, model: Model) -> tuple[list[fx.Node], set[fx.Node]]:
    """Nodes (in order) whose values depend on position_ids and constants only, and the subset
    of them that position_ids feeds."""
    pure: list[fx.Node] = []
    seen, from_pos = {pos}, {pos}
    for n in graph.nodes:
        if n.op == "get_attr":
            spec = model.weights.get(n.target)
            if spec is not None and spec.const is not None and not spec.sources:
                seen.add(n)
                pure.append(n)
        elif n.op == "call_function" and n.target not in _RANDOM:
            ins = _nodes_in(n.args) + _nodes_in(n.kwargs)
            if ins and all(i in seen for i in ins):
                seen.add(n)
                pure.append(n)
                if any(i in from_pos for i in ins):
                    from_pos.add(n)
    return pure, from_pos


def _evaluate(pure: list[fx.Node], pos: fx.Node, positions: torch.Tensor, model: Model) -> dict[fx.Node, Any]:
    env: dict[fx.Node, Any] = {pos: positions}

    def load(a):
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(load(x) for x in a)
        if isinstance(a, dict):
            return {k: load(v) for k, v in a.items()}
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    for n in pure:
        if n.op == "get_attr":
            env[n] = model.weights[attr_name(n)].const
        else:
            kwargs = {k: (torch.device("cpu") if k == "device" else load(v)) for k, v in n.kwargs.items()}
            env[n] = call_target(n)(*load(n.args), **kwargs)
    return env


def _read_sizes_from_positions(graph: fx.Graph, pos: fx.Node) -> None:
    """sym_size(x, d) of another input whose size export proved to be one of position_ids' ->
    sym_size(position_ids, d'): the same value, so a chain that sizes itself by the batch
    (transformers 5.17's RoPE expands inv_freq to `position_ids.shape[0]`, which export may read
    off `last_idx`) depends on the positions alone and folds."""
    dims = pos.meta.get("val")
    if not isinstance(dims, torch.Tensor):
        return
    syms = {str(d): i for i, d in enumerate(dims.shape) if isinstance(d, torch.SymInt)}
    for n in graph.nodes:
        if (
            n.op == "call_function"
            and n.target is aten.sym_size.int
            and n.args[0] is not pos
            and isinstance(v := n.meta.get("val"), torch.SymInt)
            and str(v) in syms
        ):
            n.args = (pos, syms[str(v)])


def fold_position_tables(model: Model) -> Model:
    max_seq = model.options.max_seq
    for _, graph in model.graphs():
        pos = next((n for n in graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)
        if pos is None:
            continue
        _read_sizes_from_positions(graph, pos)
        pure, from_pos = _position_only(graph, pos, model)
        pure_set = set(pure)
        frontier = [n for n in pure if n in from_pos and any(u not in pure_set for u in n.users)]
        # an unsqueeze of a table value (cos[:, None] where no rotary fusion took it) stays, reading
        # the table: the table is of the value before it, [batch, seq, ...]
        frontier = list(
            dict.fromkeys(
                arg_node(n, 0) if n.target is aten.unsqueeze.default and n.args[0] in from_pos else n for n in frontier
            )
        )
        frontier = [n for n in frontier if isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim() >= 2]
        if not frontier:
            continue
        table_env = _evaluate(pure, pos, torch.arange(max_seq).reshape(1, max_seq), model)
        # the ragged program's positions are [1, tokens]: its batch of one is static
        rows = 1 if pos.meta["val"].shape[0] == 1 else 3
        probe = torch.randint(0, max_seq, (rows, 5), generator=torch.Generator().manual_seed(0))
        probe_env = _evaluate(pure, pos, probe, model)
        names = stable_names(graph)
        for n in frontier:
            table, want = table_env[n], probe_env[n]
            if not (
                isinstance(table, torch.Tensor)
                and table.shape[:2] == (1, max_seq)
                and isinstance(want, torch.Tensor)
                and want.shape[:2] == probe.shape
                and torch.equal(table[0][probe], want)
            ):
                continue  # not a per-position function of the positions
            src = n  # named after the value before its dtype casts, so every dtype names it alike
            while src.target in _CASTS and isinstance(src.args[0], fx.Node) and src.args[0] in pure_set:
                src = src.args[0]
            name = f"{names[src]}.table"  # e.g. model.rotary_emb.cos.table
            table = table[0].contiguous()
            model.weights[name] = WeightSpec(
                sources=(), shape=tuple(table.shape), dtype=str(table.dtype).removeprefix("torch."), const=table
            )
            with graph.inserting_before(n):
                t = graph.get_attr(name)
                look = graph.call_function(aten.index.Tensor, (t, [pos]))
            with model.fake_mode:
                t.meta["val"] = torch.empty(table.shape, dtype=table.dtype)
            look.meta.update({k: v for k, v in n.meta.items() if k != "kernel"})
            n.replace_all_uses_with(look)
            model.counters["fold_position_tables.table"] += 1
        for n in reversed(pure):  # the chain the lookups replaced, its constants last
            if not n.users:
                graph.erase_node(n)
    return model
