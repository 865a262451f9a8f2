"""Static memory plan of a program: where each intermediate lives in one workspace arena.

Each call node's output gets an offset in an arena; two outputs share bytes only if their
lifetimes (definition .. last use, with views keeping their base alive) do not overlap.
Offsets are assigned greedily, largest buffer first, at the lowest offset that fits — the
arena size is the step's workspace bound for a given batch. On CUDA the captured graphs'
private memory pool is what actually holds these buffers; the plan is the bound `dsc bench`
and `dsc inspect` report and the test suite checks for soundness (no live overlap).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass

from dsc.errors import UserError

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "float8_e4m3fn": 1,
    "uint8": 1,
    "bool": 1,
    "float64": 8,
}
# ops whose output aliases an input (no new storage)
_VIEWS = re.compile(
    r"^aten\.(view|_unsafe_view|reshape|transpose|t|permute|unsqueeze|squeeze|expand|slice|select|"
    r"split|split_with_sizes|chunk|alias|as_strided|narrow|unflatten|flatten|detach)\.|^operator\.getitem$"
)
# ops that produce no tensor on the device (sizes)
_SCALARS = re.compile(r"^aten\.sym_size|^operator\.(?!getitem)|^torch\.sym|^math\.")


@dataclass
class Buffer:
    node: str
    nbytes: int
    start: int  # index of the defining node
    end: int  # index of the last node that reads it (through views)
    offset: int = -1


# A symbolic dim is plan text: a small integer expression over the size names ("batch",
# "seq", "2*seq + 1"). It is parsed, never evaluated by Python: names, non-negative integer
# constants, + - * // % and unary minus; no calls, attributes or powers, and every value
# bounded, so that no plan text can run code or hang the reader.
_DIM_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}
_DIM_LIMIT = 1 << 48  # larger than any real tensor dim, small enough that products stay cheap
_DIM_TEXT_LIMIT = 200


def parse_dim(text: str) -> ast.expr:
    """The checked expression tree of a symbolic dim; ValueError says what is wrong."""
    if not isinstance(text, str) or not text or len(text) > _DIM_TEXT_LIMIT:
        raise ValueError(f"symbolic dim {str(text)[:40]!r} is not a short expression")
    return _parse_dim(text)


@functools.lru_cache(maxsize=4096)  # a plan repeats a few dims ("batch", "seq") on every node
def _parse_dim(text: str) -> ast.expr:
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"symbolic dim {text!r} is not an expression") from None
    for node in ast.walk(tree):
        ok = (
            isinstance(node, ast.Name)
            and node.id.isidentifier()
            or isinstance(node, ast.Constant)
            and type(node.value) is int
            and 0 <= node.value < _DIM_LIMIT
            or isinstance(node, ast.BinOp)
            and type(node.op) in _DIM_OPS
            or isinstance(node, ast.UnaryOp)
            and isinstance(node.op, ast.USub)
            or isinstance(node, (ast.Load, ast.operator, ast.unaryop))
        )
        if not ok:
            raise ValueError(f"symbolic dim {text!r}: only size names, integers and + - * // % are allowed")
    return tree


def eval_dim(text: str, sizes: dict[str, int]) -> int:
    """The value of a symbolic dim at concrete sizes (e.g. {"batch": 8, "seq": 1})."""

    def ev(node: ast.expr) -> int:
        if isinstance(node, ast.Constant):
            assert type(node.value) is int  # parse_dim admits no other constant
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in sizes:
                raise ValueError(f"symbolic dim {text!r}: unknown size {node.id!r} (known: {', '.join(sizes)})")
            return sizes[node.id]
        if isinstance(node, ast.UnaryOp):
            return -ev(node.operand)
        assert isinstance(node, ast.BinOp)  # parse_dim admits no other expression
        a, b = ev(node.left), ev(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
            raise ValueError(f"symbolic dim {text!r} divides by zero")
        v = _DIM_OPS[type(node.op)](a, b)
        if abs(v) >= _DIM_LIMIT:
            raise ValueError(f"symbolic dim {text!r} is out of range")
        return v

    v = ev(parse_dim(text))
    if v < 0:
        raise ValueError(f"symbolic dim {text!r} is negative ({v})")
    return v


def _nbytes(node: dict, sizes: dict[str, int]) -> int:
    shape = node.get("shape")
    if not isinstance(shape, list) or "dtype" not in node:
        return 0
    n = _DTYPE_BYTES.get(node["dtype"], 4)
    for d in shape:
        try:
            n *= d if isinstance(d, int) else eval_dim(d, sizes)
        except ValueError as e:
            raise UserError(f"plan.json: node {str(node.get('name'))[:80]!r}: {e}") from None
    return n


def node_refs(a) -> list[str]:
    """The node names an encoded plan argument refers to (plan.json's {"node": name}), in order."""
    if isinstance(a, list):
        return [r for x in a for r in node_refs(x)]
    if isinstance(a, dict):
        if set(a) == {"node"}:
            return [a["node"]]
        if set(a) == {"dict"}:
            return [r for v in a["dict"].values() for r in node_refs(v)]
    return []


_SPAN = 64


def plan_memory(nodes: list[dict], sizes: dict[str, int]) -> tuple[int, list[Buffer]]:
    """Arena bytes and buffer placement for one program at concrete sizes (e.g. {"batch": 8})."""
    index = {n["name"]: i for i, n in enumerate(nodes)}
    base: dict[str, str] = {}  # view -> storage owner
    bufs: dict[str, Buffer] = {}
    for i, n in enumerate(nodes):
        if n["kind"] != "call" or _SCALARS.match(n["op"]):
            continue
        if _VIEWS.match(n["op"]):
            srcs = [r for r in node_refs(n["args"]) if r in bufs or r in base]
            if srcs:
                base[n["name"]] = base.get(srcs[0], srcs[0])
            continue
        bufs[n["name"]] = Buffer(n["name"], _nbytes(n, sizes), i, i)
    for i, n in enumerate(nodes):
        if n["kind"] in ("call", "output"):
            for r in node_refs(n.get("args", [])) + node_refs(list(n.get("kwargs", {}).values())):
                owner = base.get(r, r)
                if owner in bufs:
                    bufs[owner].end = max(bufs[owner].end, i)
    if nodes and nodes[-1]["kind"] == "output":  # outputs live to the end
        for r in node_refs(nodes[-1]["args"]):
            owner = base.get(r, r)
            if owner in bufs:
                bufs[owner].end = len(nodes)
    placed: list[Buffer] = []
    # placed buffers by the spans of _SPAN nodes their lifetimes touch: finding the ones alive
    # with b looks at b's spans only, so placement is linear in the program, not quadratic
    by_span: dict[int, list[Buffer]] = {}
    for b in sorted(bufs.values(), key=lambda b: (-b.nbytes, b.start)):
        spans = range(b.start // _SPAN, b.end // _SPAN + 1)
        alive = {id(p): p for k in spans for p in by_span.get(k, ()) if p.start <= b.end and b.start <= p.end}
        live = sorted((p.offset, p.offset + p.nbytes) for p in alive.values())
        off = 0
        for lo, hi in live:
            if off + b.nbytes <= lo:
                break
            off = max(off, _align(hi))
        b.offset = off
        placed.append(b)
        for k in spans:
            by_span.setdefault(k, []).append(b)
    arena = max((b.offset + b.nbytes for b in placed), default=0)
    del index
    return arena, placed


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def workspace_bytes(plan: dict, program: str = "decode", batch: int = 1, seq: int = 1) -> int:
    arena, _ = plan_memory(plan["programs"][program]["nodes"], {"batch": batch, "seq": seq})
    return arena
