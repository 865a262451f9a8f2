"""The kernel plan's program format: an FX graph written as JSON, and read back into one.

A program is a list of nodes in execution order. Each node is a dict:

    {"name": "model.layers.0.self_attn.q_proj.linear", "kind": "call",
     "op": "aten.linear.default", "args": [{"node": "..."}, {"node": "...weight"}],
     "kwargs": {}, "shape": ["batch", "seq", 64], "dtype": "float32", "kernel": {...}}

kinds: "input" (a program input), "weight" (a tensor from the rank file or the KV cache,
`target` names it), "call" (`op` is a stable schema name: `aten.mm.default`,
`dsc.attention.default`, `operator.getitem`), "output". Argument encoding: a node reference is
{"node": name}; dtypes, devices, layouts and memory formats are tagged dicts; devices are
written as {"device": "target"} and bound to the runtime's device when the graph is rebuilt.

A plan is untrusted data. `build_graph` checks every node before it builds anything: names and
targets are dotted identifiers, kwargs keys identifiers (FX writes all three into the Python
source it generates), ops are in the op table (kernels/registry.py) and their arguments of the
kinds the op accepts, tags name a value from a fixed list; a violation is one UserError line
naming the node and the field.

This module is shared by the compiler (writing) and the runtime (reading); it needs torch only.
"""

from __future__ import annotations

import functools
import keyword
import math
import re
from typing import Any

import torch
import torch.fx as fx

from dsc.errors import UserError
from dsc.kernels import registry
from dsc.kernels.registry import op_name, resolve_op  # noqa: F401  (the format's op names)
from dsc.runtime.artifact import SAFE_NAME  # the dotted-name rule rank files and the loader share

# the ops that attend over a layer's KV cache and write the new tokens into it
ATTENTION_OPS = registry.ops_with("attention")
# table lookups: a step reads the rows of its tokens, at most one per token, not the table (arg 0)
GATHER_OPS = registry.ops_with("gather")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# a tag names one of torch's values of its type, never any other attribute of torch
_TAGS: dict[str, dict[str, Any]] = {
    tag: {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, kind)}
    for tag, kind in (("dtype", torch.dtype), ("layout", torch.layout), ("memory_format", torch.memory_format))
}
_NUMBER = (int, float)


def encode_arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, (list, tuple)):
        return [encode_arg(x) for x in a]
    if isinstance(a, dict):
        return {"dict": {k: encode_arg(v) for k, v in a.items()}}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": "target"}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    if isinstance(a, float) and not math.isfinite(a):
        return {"float": repr(a)}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise ValueError(f"cannot encode argument {a!r} ({type(a).__name__}) in a plan")


def decode_arg(a: Any, env: dict[str, fx.Node], device: torch.device) -> Any:
    """An argument `check_nodes` accepted, as the FX value it encodes."""
    if isinstance(a, list):
        return [decode_arg(x, env, device) for x in a]
    if isinstance(a, dict):
        ((tag, val),) = a.items()
        if tag == "node":
            return env[val]
        if tag == "dict":
            return {k: decode_arg(v, env, device) for k, v in val.items()}
        if tag == "device":
            return device
        if tag == "float":
            return float(val)
        return _TAGS[tag][val]
    return a


# -- checks ----------------------------------------------------------------------------------
class _Bad(Exception):
    """A field of one node is bad; build_graph adds where."""


def _check_arg(a: Any, defined: set[str], field: str = "args", depth: int = 0) -> None:
    """`a` is a well-formed encoded argument: plain values, lists, known tags, references to
    nodes defined before."""
    if depth > 16:
        raise _Bad(field, "nested too deeply")
    if a is None or isinstance(a, (bool, int, str)) or (isinstance(a, float) and math.isfinite(a)):
        return
    if isinstance(a, list):
        for x in a:
            _check_arg(x, defined, field, depth + 1)
        return
    if not isinstance(a, dict) or len(a) != 1:
        raise _Bad(field, f"{_short(a)} is not an encoded argument")
    ((tag, val),) = a.items()
    if tag == "node":
        if not isinstance(val, str) or val not in defined:
            raise _Bad(field, f"refers to {_short(val)}, which no earlier node defines")
    elif tag == "dict":
        if not isinstance(val, dict):
            raise _Bad(field, "a dict argument is not an object")
        for k, v in val.items():
            _check_identifier(k, field, "dict key")
            _check_arg(v, defined, field, depth + 1)
    elif tag == "device":
        if val != "target":
            raise _Bad(field, f'device {_short(val)} (only "target")')
    elif tag == "float":
        if val not in ("inf", "-inf", "nan"):
            raise _Bad(field, f"float {_short(val)} (only inf, -inf, nan)")
    elif tag in _TAGS:
        if not isinstance(val, str) or val not in _TAGS[tag]:
            raise _Bad(field, f"{tag} {_short(val)} is not a torch {tag}")
    else:
        raise _Bad(field, f"unknown argument tag {_short(tag)}")


def _is_tag(a: Any, *tags: str) -> bool:
    return isinstance(a, dict) and len(a) == 1 and next(iter(a)) in tags


def _fits(t: torch._C.JitType, a: Any) -> bool:
    """An encoded argument is of a kind that schema type t accepts (a node fits any scalar)."""
    kind = t.kind()
    if kind == "OptionalType":
        return a is None or _fits(t.getElementType(), a)
    if kind == "ListType":
        return isinstance(a, list) and all(_fits(t.getElementType(), x) for x in a)
    if _is_tag(a, "node"):
        return kind not in ("StringType", "DeviceObjType")
    if kind == "TensorType":  # a scalar stands for a 0-dim tensor
        return isinstance(a, _NUMBER) or _is_tag(a, "float")
    if kind in ("IntType", "SymIntType"):  # dtypes, layouts and memory formats are ints in schemas
        return (isinstance(a, int) and not isinstance(a, bool)) or _is_tag(a, "dtype", "layout", "memory_format")
    if kind in ("FloatType", "NumberType"):
        return isinstance(a, _NUMBER) or _is_tag(a, "float")
    if kind == "BoolType":
        return isinstance(a, bool)
    if kind == "StringType":
        return isinstance(a, str)
    if kind == "DeviceObjType":
        return _is_tag(a, "device")
    return True


def _check_call(n: dict, defined: set[str]) -> None:
    op = n.get("op")
    if not registry.is_known(op):
        raise _Bad("op", f"{_short(op)} is not an op dsc emits")
    args, kwargs = n.get("args"), n.get("kwargs", {})
    if not isinstance(args, list):
        raise _Bad("args", "not a list")
    if not isinstance(kwargs, dict):
        raise _Bad("kwargs", "not an object")
    for k in kwargs:
        _check_identifier(k, "kwargs", "key")
    _check_arg(args, defined)
    _check_arg(list(kwargs.values()), defined, "kwargs")
    if op in registry.PYTHON_OPS:
        kinds = registry.PYTHON_OPS[op][1]
        if kwargs or len(args) != len(kinds) or not all(map(_fits_python, kinds, args)):
            raise _Bad("args", f"{op} takes ({', '.join(kinds)})")
        return
    params, positional = _parameters(op)
    if len(args) > len(positional):
        raise _Bad("args", f"{op} takes at most {len(positional)} positional arguments, got {len(args)}")
    for k in kwargs:
        if k not in params:
            raise _Bad("kwargs", f"key {k!r} is not an argument of {op}")
    for p, a in [*zip(positional, args), *((params[k], v) for k, v in kwargs.items())]:
        if not _fits(p.type, a):
            raise _Bad("args", f"argument {p.name} of {op} ({p.type}) cannot be {_short(a)}")


@functools.cache
def _parameters(op: str) -> tuple[dict[str, Any], list[Any]]:
    """A torch op's schema arguments by name, and its positional ones in order."""
    schema = registry.resolve_torch_op(op)._schema
    return {p.name: p for p in schema.arguments}, [p for p in schema.arguments if not p.kwarg_only]


def _fits_python(kind: str, a: Any) -> bool:
    if kind == "index":
        return isinstance(a, int) and not isinstance(a, bool)
    return _is_tag(a, "node") or isinstance(a, _NUMBER)


def _check_identifier(s: Any, field: str, what: str) -> None:
    if not isinstance(s, str) or not _IDENTIFIER.fullmatch(s) or keyword.iskeyword(s):
        raise _Bad(field, f"{what} {_short(s)} is not an identifier")


def _check_dotted(s: Any, field: str) -> None:
    if not isinstance(s, str) or not SAFE_NAME.fullmatch(s):
        raise _Bad(
            field, f"{_short(s)} is not a dotted name of letters, digits and underscores (at most 300 characters)"
        )


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def check_nodes(nodes: Any, where: str = "plan.json") -> None:
    """Every node of a program is well-formed (see the module docstring); UserError otherwise."""
    if not isinstance(nodes, list):
        raise UserError(f"{where}: field 'nodes' is not a list")
    defined: set[str] = set()
    for i, n in enumerate(nodes):
        label = f"node {i}"
        try:
            if not isinstance(n, dict):
                raise _Bad("node", "not an object")
            kind = n.get("kind")
            if kind != "output":
                _check_dotted(n.get("name"), "name")
                label = f"node {n['name']!r}"
                if n["name"] in defined:
                    raise _Bad("name", "defined twice")
            if kind == "input":
                _check_identifier(n["name"], "name", "input name")
            elif kind == "weight":
                _check_dotted(n.get("target"), "target")
            elif kind == "call":
                _check_call(n, defined)
            elif kind == "output":
                _check_arg(n.get("args"), defined)
            else:
                raise _Bad("kind", f"unknown node kind {_short(kind)}")
        except _Bad as e:
            field, what = e.args
            raise UserError(f"{where}: {label}: field '{field}': {what}") from None
        if kind != "output":
            defined.add(n["name"])


def build_graph(nodes: Any, device: torch.device, where: str = "plan.json") -> tuple[fx.Graph, list[str]]:
    """Rebuild an FX graph from a program's node list, after `check_nodes`. Returns the graph and
    the qualified names its weight nodes read (the caller attaches those tensors to the
    GraphModule)."""
    check_nodes(nodes, where)
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    weights: list[str] = []
    for n in nodes:
        kind = n["kind"]
        if kind == "input":
            env[n["name"]] = g.placeholder(n["name"])
        elif kind == "weight":
            env[n["name"]] = g.get_attr(n["target"])
            weights.append(n["target"])
        elif kind == "call":
            args = tuple(decode_arg(n["args"], env, device))
            kwargs = {k: decode_arg(v, env, device) for k, v in n.get("kwargs", {}).items()}
            env[n["name"]] = g.call_function(resolve_op(n["op"]), args, kwargs)
        else:
            g.output(decode_arg(n["args"], env, device))
    return g, weights
