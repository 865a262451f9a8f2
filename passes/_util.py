"""Small helpers shared by passes: node matching and replacement that keeps metadata."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from dsc.compiler.ir import copy_meta, infer_val

aten = torch.ops.aten


def is_call(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def replace_with(node: fx.Node, target: Callable, args: tuple, kwargs: dict | None = None,
                 infer: bool = True) -> fx.Node:
    """Insert target(*args) before node, take over its uses and module path, erase node."""
    g = node.graph
    with g.inserting_before(node):
        new = g.call_function(target, args, kwargs or {})
    copy_meta(new, node)
    if infer:
        infer_val(new)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new


def bypass(node: fx.Node, keep: fx.Node) -> None:
    """Remove node, routing its users to `keep`."""
    node.replace_all_uses_with(keep)
    node.graph.erase_node(node)
