"""Patterns written as eager torch, matched on dsc programs; and fused-node insertion.

A `Pattern` is a plain torch function plus example inputs. It is traced once per process
with `make_fx(pre_dispatch=True)` (the ATen level `torch.export` gives dsc programs) for each
example dtype; no-op casts are dropped as `canonicalize` drops them, so one function covers
the fp32 spelling (no casts) and the 16-bit one (casts around the fp32 math). Literal
arguments listed in `wildcards` (traced with a sentinel value: an eps, a half head size, a
dtype) become placeholders, so a match binds them to the program's values. Matching is
torch.fx's SubgraphMatcher: same ops, same other literals, and no node inside a match used
outside it (only the pattern's output may be).

    m = RMSNORM.matches(graph)[0]
    m["x"], m["weight"], m["eps"]   # what the pattern's inputs and wildcards bound to
    m.output                        # the program node the pattern's result is
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from dsc.compiler.ir import copy_meta, infer_val
from dsc.passes._util import aten


@dataclass
class Match:
    bindings: dict[str, Any]  # pattern input / wildcard name -> program node or literal
    output: fx.Node
    nodes: list[fx.Node]  # the program nodes the pattern's ops matched

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.bindings.get(name, default)


@dataclass
class Pattern:
    fn: Callable[..., torch.Tensor]  # eager torch; tensor arguments only
    example: Callable[[torch.dtype], tuple]  # example tensor arguments for a dtype
    wildcards: dict[str, Any] = field(default_factory=dict)  # name -> sentinel literal in the trace
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    _graphs: list[fx.Graph] | None = field(default=None, repr=False, compare=False)  # traced on first use

    def graphs(self) -> list[fx.Graph]:
        if self._graphs is None:
            names = list(inspect.signature(self.fn).parameters)
            out: list[fx.Graph] = []
            for dt in self.dtypes:
                g = _trace(self.fn, self.example(dt), names, self.wildcards)
                if not any(_same_graph(g, h) for h in out):
                    out.append(g)
            self._graphs = out
        return self._graphs

    def matches(self, graph: fx.Graph) -> list[Match]:
        """Non-overlapping matches, in program order of their outputs."""
        found: list[Match] = []
        taken: set[fx.Node] = set()
        for pg in self.graphs():
            for m in SubgraphMatcher(pg).match(graph):
                nodes = [gn for pn, gn in m.nodes_map.items() if pn.op not in ("placeholder", "output")]
                if taken.intersection(nodes):
                    continue
                taken.update(nodes)
                binds = {pn.name: gn for pn, gn in m.nodes_map.items() if pn.op == "placeholder"}
                found.append(Match(binds, m.returning_nodes[0], nodes))
        order = {n: i for i, n in enumerate(graph.nodes)}
        return sorted(found, key=lambda m: order[m.output])


def _trace(fn, args, names: list[str], wildcards: dict[str, Any]) -> fx.Graph:
    g = make_fx(fn, pre_dispatch=True)(*args).graph
    for p, name in zip([n for n in g.nodes if n.op == "placeholder"], names):
        p.name = p.target = name
    for n in list(g.nodes):  # drop no-op casts, as canonicalize does
        if n.target is aten.to.dtype and n.args[0].meta["val"].dtype == n.args[1]:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
    first = next(n for n in g.nodes if n.op != "placeholder")
    for name, sentinel in wildcards.items():
        holder = None

        def swap(a):
            nonlocal holder
            if type(a) is type(sentinel) and a == sentinel:
                if holder is None:
                    with g.inserting_before(first):
                        holder = g.placeholder(name)
                return holder
            return a

        for n in g.nodes:
            if n.op == "call_function":
                n.args = fx.node.map_aggregate(n.args, swap)
    g.eliminate_dead_code()
    g.lint()
    return g


def _same_graph(a: fx.Graph, b: fx.Graph) -> bool:
    def sig(g):
        return [(n.op, str(n.target), str(n.args)) for n in g.nodes]

    return sig(a) == sig(b)


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def insert_call(graph: fx.Graph, target: Callable, args: tuple, meta_from: fx.Node) -> fx.Node:
    """Insert `target(*args)` right after the last of its input nodes (a weight read later in
    the program moves up: get_attr has no inputs; a program input's reader goes after all the
    inputs), with meta_from's module path and its own inferred val."""
    order = node_order(graph)
    inputs = [a for a in _flatten(args) if isinstance(a, fx.Node)]
    computed = [a for a in inputs if a.op != "get_attr"] or inputs
    last = max(computed, key=order.__getitem__)
    if last.op == "placeholder":
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        new = graph.call_function(target, args)
    for a in inputs:
        if a.op == "get_attr" and order[a] > order[last]:
            new.prepend(a)
    copy_meta(new, meta_from)
    infer_val(new)
    return new


def insert_fused(graph: fx.Graph, target: Callable, args: tuple, replaces: list[fx.Node]) -> fx.Node:
    """Insert `target(*args)` (see insert_call) and make it take over the uses of `replaces`:
    the op's result if it returns one tensor (`replaces` = [node]), or its i-th output (a
    getitem node with replaces[i]'s module path) if it returns a tuple. Dead pattern nodes
    are left for the caller's dead-code elimination."""
    fused = insert_call(graph, target, args, replaces[-1])
    if len(replaces) == 1 and not isinstance(fused.meta["val"], (tuple, list)):
        replaces[0].replace_all_uses_with(fused)
        return fused
    anchor = fused
    for i, old in enumerate(replaces):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (fused, i))
        copy_meta(item, old)
        infer_val(item)
        old.replace_all_uses_with(item)
        anchor = item
    return fused


def _flatten(a: Any) -> list:
    if isinstance(a, (list, tuple)):
        return [y for x in a for y in _flatten(x)]
    return [a]
