"""Write programs as plan nodes (runtime/plan.py describes the format) and as dump text.

Node names are stable and readable: the Hugging Face module path of the node plus the op
(`model.layers.3.self_attn.q_proj.linear`), made unique by a numeric suffix in program order.
Symbolic sizes are written with the names of the program inputs' dims (`batch`, `seq`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

from dsc.compiler.ir import Model
from dsc.runtime.plan import encode_arg, op_name

_SYM = re.compile(r"\b[su]\d+\b")


def _module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    if not isinstance(path, str) or path.startswith("_"):
        return None
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = path.removeprefix("L['self'].")
    return None if path == "lm" else path.removeprefix("lm.") or None  # not "lm_head" -> "_head"


def _dim(d: Any, sym_names: dict[str, str]) -> Any:
    if isinstance(d, int):
        return d
    return _SYM.sub(lambda m: sym_names.get(m.group(0), m.group(0)), str(d))


def describe_val(val: Any, sym_names: dict[str, str]) -> dict:
    if isinstance(val, torch.Tensor):
        return {"shape": [_dim(d, sym_names) for d in val.shape], "dtype": str(val.dtype).removeprefix("torch.")}
    if isinstance(val, (torch.SymInt, int)):
        return {"shape": "int", "value": _dim(val, sym_names)}
    if isinstance(val, (list, tuple)):
        return {"shape": [describe_val(v, sym_names).get("shape") for v in val]}
    return {}


def stable_names(graph: fx.Graph) -> dict[fx.Node, str]:
    names: dict[fx.Node, str] = {}
    used: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            base = n.name
        elif n.op == "get_attr":
            base = n.target
        elif n.op == "output":
            base = "output"
        else:
            short = op_name(n.target).split(".")[1]
            path = _module_path(n)
            base = f"{path}.{short}" if path else short
        k = used.get(base, 0)
        used[base] = k + 1
        names[n] = base if k == 0 else f"{base}_{k}"
    return names


def program_nodes(graph: fx.Graph, sym_names: dict[str, str]) -> list[dict]:
    names = stable_names(graph)
    out = []
    for n in graph.nodes:
        # encode references by stable name
        enc = lambda a: _rename(encode_arg(a), n, names)  # noqa: E731
        if n.op == "placeholder":
            d = {"name": names[n], "kind": "input"}
        elif n.op == "get_attr":
            d = {"name": names[n], "kind": "weight", "target": n.target}
        elif n.op == "output":
            d = {"name": "output", "kind": "output", "args": enc(n.args[0])}
        else:
            d = {
                "name": names[n],
                "kind": "call",
                "op": op_name(n.target),
                "args": enc(list(n.args)),
                "kwargs": {k: enc(v) for k, v in n.kwargs.items()},
            }
            if "kernel" in n.meta:
                d["kernel"] = n.meta["kernel"]
        if n.op != "output":
            d.update(describe_val(n.meta.get("val"), sym_names))
        out.append(d)
    return out


def _rename(enc: Any, node: fx.Node, names: dict[fx.Node, str]) -> Any:
    by_name = {m.name: names[m] for m in node.all_input_nodes}

    def walk(a):
        if isinstance(a, list):
            return [walk(x) for x in a]
        if isinstance(a, dict):
            if set(a) == {"node"}:
                return {"node": by_name[a["node"]]}
            if set(a) == {"dict"}:
                return {"dict": {k: walk(v) for k, v in a["dict"].items()}}
        return a

    return walk(enc)


def _fmt_arg(a: Any) -> str:
    if isinstance(a, list):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    if isinstance(a, dict):
        ((tag, val),) = a.items()
        if tag == "node":
            return f"%{val}"
        if tag == "dict":
            return "{" + ", ".join(f"{k}: {_fmt_arg(v)}" for k, v in val.items()) + "}"
        return f"{val}" if tag != "device" else "<device>"
    return repr(a)


def nodes_to_text(nodes: list[dict]) -> str:
    """One line per node: `%name = op(args)  : shape dtype  [kernel]`."""
    lines = []
    for d in nodes:
        ty = ""
        if "dtype" in d:
            ty = f"  : {d['dtype']}{d['shape']}"
        elif d.get("shape") == "int":
            ty = f"  : int = {d.get('value')}"
        if d["kind"] == "input":
            lines.append(f"%{d['name']} = input(){ty}")
        elif d["kind"] == "weight":
            lines.append(f"%{d['name']} = weight({d['target']}){ty}")
        elif d["kind"] == "output":
            lines.append(f"return {_fmt_arg(d['args'])}")
        else:
            args = [_fmt_arg(a) for a in d["args"]] + [f"{k}={_fmt_arg(v)}" for k, v in d["kwargs"].items()]
            kern = f"  [{d['kernel']['name']}]" if "kernel" in d else ""
            lines.append(f"%{d['name']} = {d['op']}({', '.join(args)}){ty}{kern}")
    return "\n".join(lines) + "\n"


def model_to_text(model: Model) -> str:
    parts = []
    for name, graph in model.graphs():
        parts.append(f"program {name}:\n" + nodes_to_text(program_nodes(graph, model.sym_names.get(name, {}))))
    w = [f"  {k}: {v.describe()}" for k, v in sorted(model.weights.items())]
    parts.append("weights:\n" + "\n".join(w) + "\n")
    return "\n".join(parts)
