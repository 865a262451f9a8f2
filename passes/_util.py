"""Small helpers shared by passes: node matching and replacement that keeps metadata."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import torch
import torch.fx as fx
from torch.fx.node import Argument

from dsc.compiler.ir import copy_meta, infer_val

aten = torch.ops.aten


def is_call(node: object, *targets: object) -> TypeGuard[fx.Node]:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def arg_node(n: fx.Node, i: int) -> fx.Node:
    """n.args[i] where the op's schema makes it a tensor: the node that computes it."""
    a = n.args[i]
    if not isinstance(a, fx.Node):
        raise TypeError(f"{n.name} ({n.target}): argument {i} is {a!r}, not a node")
    return a


def arg_int(n: fx.Node, i: int, default: int | None = None, kwarg: str | None = None) -> int:
    """n.args[i], a literal int of the op (a dim, a size, a count). Where n has fewer
    arguments: kwargs[kwarg] if it is given there, else `default` if there is one."""
    if i < len(n.args):
        a = n.args[i]
    elif kwarg is not None and kwarg in n.kwargs:
        a = n.kwargs[kwarg]
    elif default is not None:
        return default
    else:
        raise IndexError(f"{n.name} ({n.target}) has no argument {i}")
    if not isinstance(a, int):
        raise TypeError(f"{n.name} ({n.target}): argument {i} is {a!r}, not an int")
    return a


def arg_float(n: fx.Node, i: int, default: float | None = None) -> float:
    """n.args[i], a literal number of the op (an eps, a scale), as a float; `default` where n
    has fewer arguments, if there is one."""
    if i >= len(n.args) and default is not None:
        return default
    a = n.args[i]
    if not isinstance(a, (int, float)):
        raise TypeError(f"{n.name} ({n.target}): argument {i} is {a!r}, not a number")
    return float(a)


def arg_list(n: fx.Node, i: int) -> list[Argument]:
    """n.args[i], a list argument of the op (tensors to concatenate, a view's sizes), as a new list."""
    a = n.args[i]
    if not isinstance(a, (list, tuple)):
        raise TypeError(f"{n.name} ({n.target}): argument {i} is {a!r}, not a list")
    return list(a)


def arg_ints(n: fx.Node, i: int) -> list[int]:
    """n.args[i], a list of literal ints (dims), as a new list."""
    out = []
    for d in arg_list(n, i):
        if not isinstance(d, int):
            raise TypeError(f"{n.name} ({n.target}): argument {i} holds {d!r}, not an int")
        out.append(d)
    return out


def attr_name(n: fx.Node) -> str:
    """The name of the weight (a key of Model.weights) that the get_attr node n reads."""
    if n.op != "get_attr" or not isinstance(n.target, str):
        raise TypeError(f"{n.name} ({n.op} {n.target}) does not read a weight")
    return n.target


def call_target(n: fx.Node) -> Callable[..., Any]:
    """The function a call_function node calls."""
    if not callable(n.target):
        raise TypeError(f"{n.name} ({n.op} {n.target}) does not call a function")
    return n.target


def replace_with(
    node: fx.Node, target: Callable, args: tuple, kwargs: dict | None = None, infer: bool = True
) -> fx.Node:
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


def take_bias(value: Any, consumer: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """Detach the bias from `value` for `consumer` to add instead (its only user), or None.

    value = linear(x, W, b)  -> the same linear without b (rewritten in place), b
    value = add(t, b) / add(b, t), b a [N] vector over t's last dim (a row-parallel linear's
            bias, added once after its all-reduce)  -> t, b  (the add dies with its last use)
    value = view(v) of such a v, N kept last (the [rows, N] linear viewed back)  -> value, b
    The consumer then computes f(value' + b), rounding value' + b to the dtype first as the
    unfused linear's output was. At batch 1 cuBLAS has no bias epilogue (torch runs a copy
    of the bias and a GEMV), so each bias moved into a kernel that runs anyway saves a launch."""
    if not isinstance(value, fx.Node) or list(value.users) != [consumer]:
        return None
    vv = value.meta.get("val")
    if not isinstance(vv, torch.Tensor):
        return None
    if is_call(value, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        # canonicalize's [rows, N] linear viewed back to [..., N]: the bias still runs along N
        src = value.args[0]
        if not isinstance(src, fx.Node):
            return None
        vs = src.meta.get("val")
        if isinstance(vs, torch.Tensor) and vs.dim() >= 1 and vs.shape[-1] == vv.shape[-1]:
            taken = take_bias(src, value)
            if not taken:
                return None
            if taken[0] is not src:  # the bias add is bypassed: view its input instead
                value.replace_input_with(src, taken[0])
            return value, taken[1]
        return None
    if (
        is_call(value, aten.linear.default)
        and len(value.args) == 3
        and isinstance(b := value.args[2], fx.Node)
        and not value.kwargs
    ):
        value.args = value.args[:2]
        return value, b
    if is_call(value, aten.add.Tensor) and len(value.args) == 2 and not value.kwargs:
        for t, b in (value.args, value.args[::-1]):
            if not (isinstance(t, fx.Node) and isinstance(b, fx.Node)):
                continue
            vt, vb = t.meta.get("val"), b.meta.get("val")
            if (
                isinstance(vt, torch.Tensor)
                and isinstance(vb, torch.Tensor)
                and vt.shape == vv.shape
                and vt.dtype == vv.dtype
                and tuple(vb.shape) == (vv.shape[-1],)
                and vb.dtype == vv.dtype
            ):
                return t, b
    return None


# what a router computes between its linear and the experts: scores, top-k, renormalization
_ROUTING = {
    aten.softmax.int,
    aten.topk.default,
    aten.sum.dim_IntList,
    aten.div.Tensor,
    aten.div_.Tensor,
    aten.to.dtype,
    aten._to_copy.default,
    aten.sigmoid.default,
    aten.view.default,
    aten.reshape.default,
}


def is_router(linear: fx.Node) -> bool:
    """A linear whose output reaches a dsc.moe's routing (ids or weights) through routing ops
    only (_ROUTING): a mixture of experts' router."""
    import operator

    seen, todo = set(), [linear]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.target is torch.ops.dsc.moe.default and n in u.args[1:3]:
                return True
            if u not in seen and (u.target in _ROUTING or u.target is operator.getitem):
                seen.add(u)
                todo.append(u)
    return False
