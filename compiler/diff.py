"""`dsc diff A B`: what changed between two artifacts or two pass dumps.

A and B are each an artifact folder (manifest.json, plan.json, rank files) or one entry of a
`--dump-passes` folder (`DIR/02_bind_kv_cache`: plan.json with programs and weight specs).

Nodes are matched by their stable name (`model.layers.0.self_attn.q_proj.linear`). A pass
that replaces a node gives the new one another name (the op is part of it:
`...q_proj.linear` -> `...q_proj.linear_w8a16`); such pairs are found from the data flow — a
node both sides share reads, at the same argument position, an unmatched node on each
side — and reported as *replaced*, so that the consumers of a replaced node do not show up
as changed. Per program the result lists nodes replaced, added, removed and changed (op,
arguments, shape, dtype, kernel), and the op counts that differ. Weights: for artifacts, the
rank files' tensors (dtype, shape, sha256 of the bytes); for dumps, the weight recipes.
Options and other manifest/plan fields are compared leaf by leaf.

Exit codes of the command, as diff(1): 0 identical, 1 different, 2 trouble.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsc.compiler.serialize import nodes_to_text
from dsc.errors import UserError

# manifest fields that differ between two compiles of the same thing and say nothing about it
_MANIFEST_IGNORED = {"command", "files", "source.model"}
# plan fields compared per node, or not at all (a dump's own pass name)
_PLAN_IGNORED = {"programs", "weights", "pass"}
_NODE_FIELDS = ("kind", "op", "target", "args", "kwargs", "shape", "dtype", "value", "kernel")


@dataclass
class Side:
    """One operand of a diff, read from disk."""

    path: Path
    kind: str  # "artifact" | "dump"
    plan: dict
    manifest: dict | None  # artifacts only
    weights: dict[str, dict[str, dict]]  # group ("rank0", ... or "specs") -> name -> description


def load_side(path: str | Path) -> Side:
    """Read an artifact (rank-file headers, no tensor hashes yet) or a pass dump."""
    path = Path(path)
    if (path / "manifest.json").exists():
        from dsc.runtime.artifact import open_artifact

        art = open_artifact(path, ranks=[], verify=False)
        weights = {
            f"rank{r}": rank_tensors(art.rank_file(r), hash_weights=False)
            for r in range(art.tp)
            if art.rank_file(r).exists()
        }
        return Side(path, "artifact", art.plan, art.manifest, weights)
    plan_file = path / "plan.json"
    if plan_file.exists():
        from dsc.runtime.artifact import read_json_object

        plan = read_json_object(plan_file)
        if isinstance(plan.get("programs"), dict):
            return Side(path, "dump", plan, None, {"specs": plan.get("weights", {})})
    if path.is_dir() and any((p / "plan.json").exists() for p in path.iterdir() if p.is_dir()):
        first = sorted(p.name for p in path.iterdir() if (p / "plan.json").exists())[:2]
        raise UserError(
            f"{path}: a --dump-passes folder; diff two of its entries, e.g. {path / first[0]} {path / first[-1]}"
        )
    raise UserError(f"{path}: neither a dsc artifact (manifest.json) nor a pass dump (plan.json)")


def rank_tensors(path: Path, hash_weights: bool = True) -> dict[str, dict]:
    """name -> {dtype, shape, sha256} for every tensor of a safetensors file, read without torch."""
    from dsc.runtime.artifact import read_safetensors_header

    header = read_safetensors_header(path)  # checked: names, dtypes, offsets within the file
    header.pop("__metadata__", None)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        out = {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in header.items()}
        if hash_weights and header:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as data:
                for k, v in header.items():
                    lo, hi = v["data_offsets"]
                    out[k]["sha256"] = hashlib.sha256(data[8 + n + lo : 8 + n + hi]).hexdigest()
    return out


# -- node matching -------------------------------------------------------------------------
def node_refs(arg: Any) -> Iterator[str]:
    """Names of the nodes an encoded argument refers to, depth first."""
    if isinstance(arg, list):
        for a in arg:
            yield from node_refs(a)
    elif isinstance(arg, dict):
        ((tag, val),) = arg.items()
        if tag == "node":
            yield val
        elif tag == "dict":
            for v in val.values():
                yield from node_refs(v)


def node_inputs(node: dict) -> list[str]:
    return list(node_refs(node.get("args", []))) + list(node_refs(list(node.get("kwargs", {}).values())))


def match_nodes(a: list[dict], b: list[dict]) -> dict[str, str]:
    """A-name -> B-name for the nodes both programs hold: equal names first, then replacements
    found from the data flow (same kind, read at the same input position by matched nodes)."""
    a_by, b_by = {n["name"]: n for n in a}, {n["name"]: n for n in b}
    m = {name: name for name in a_by if name in b_by}
    grew = True
    while grew:
        grew = False
        taken = set(m.values())
        for an in reversed(a):
            if an["name"] not in m:
                continue
            for x, y in zip(node_inputs(an), node_inputs(b_by[m[an["name"]]])):
                if x not in m and y not in taken and a_by[x]["kind"] == b_by[y]["kind"]:
                    m[x] = y
                    taken.add(y)
                    grew = True
    return m


def _rename_refs(arg: Any, m: dict[str, str]) -> Any:
    if isinstance(arg, list):
        return [_rename_refs(a, m) for a in arg]
    if isinstance(arg, dict):
        ((tag, val),) = arg.items()
        if tag == "node":
            return {"node": m.get(val, val)}
        if tag == "dict":
            return {"dict": {k: _rename_refs(v, m) for k, v in val.items()}}
    return arg


def _summary(n: dict) -> dict:
    return {k: n[k] for k in ("name", "kind", "op", "target", "shape", "dtype") if k in n}


def diff_program(a: list[dict], b: list[dict]) -> dict:
    """Replaced, added, removed and changed nodes, and op counts that differ."""
    m = match_nodes(a, b)
    b_by = {n["name"]: n for n in b}
    matched_b = set(m.values())
    replaced, changed = [], []
    for an in a:
        name = an["name"]
        if name not in m:
            continue
        bn = b_by[m[name]]
        if m[name] != name:
            replaced.append({"a": _summary(an), "b": _summary(bn)})
            continue
        fields = {}
        for f in _NODE_FIELDS:
            va = an.get(f)
            if f == "args":
                va = _rename_refs(va, m)
            elif f == "kwargs" and va is not None:
                va = {k: _rename_refs(v, m) for k, v in va.items()}
            if va != bn.get(f):
                fields[f] = [an.get(f), bn.get(f)]
        if fields:
            changed.append(
                {"name": name, "fields": fields, "lines": [nodes_to_text([an]).rstrip(), nodes_to_text([bn]).rstrip()]}
            )
    replaced.sort(key=lambda r: r["a"]["kind"] == "weight")  # the ops first, then their weights
    ops_a = Counter(n["op"] for n in a if n["kind"] == "call")
    ops_b = Counter(n["op"] for n in b if n["kind"] == "call")
    return {
        "replaced": replaced,
        "added": [_summary(n) for n in b if n["name"] not in matched_b],
        "removed": [_summary(n) for n in a if n["name"] not in m],
        "changed": changed,
        "op_counts": {
            op: [ops_a[op], ops_b[op]] for op in sorted(ops_a.keys() | ops_b.keys()) if ops_a[op] != ops_b[op]
        },
        "calls": [sum(ops_a.values()), sum(ops_b.values())],
    }


# -- weights and fields --------------------------------------------------------------------
def diff_weights(a: dict[str, dict], b: dict[str, dict]) -> dict:
    changed = []
    for name in sorted(a.keys() & b.keys()):
        fields = {
            k: [a[name].get(k), b[name].get(k)]
            for k in sorted(a[name].keys() | b[name].keys())
            if a[name].get(k) != b[name].get(k)
        }
        if fields:
            changed.append({"name": name, "fields": fields})
    return {
        "added": [{"name": k, **b[k]} for k in sorted(b.keys() - a.keys())],
        "removed": [{"name": k, **a[k]} for k in sorted(a.keys() - b.keys())],
        "changed": changed,
    }


def diff_fields(a: Any, b: Any, prefix: str = "", ignored: frozenset | set = frozenset()) -> dict[str, list]:
    """Dotted key -> [a, b] for the leaves that differ; a key one side lacks is one entry."""
    if prefix in ignored:
        return {}
    if isinstance(a, dict) and isinstance(b, dict):
        out: dict[str, list] = {}
        for k in sorted(a.keys() | b.keys()):
            out.update(diff_fields(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k, ignored))
        return out
    return {} if a == b else {prefix: [a, b]}


# -- the diff --------------------------------------------------------------------------------
def diff(a_path: str | Path, b_path: str | Path) -> dict:
    """The structural diff of two artifacts or pass dumps, as a JSON-ready dict."""
    a, b = load_side(a_path), load_side(b_path)
    if a.kind == b.kind == "artifact":  # hash tensors only where the rank files differ
        for g in a.weights.keys() & b.weights.keys():
            f = f"{g}.safetensors"
            if a.manifest["files"].get(f) != b.manifest["files"].get(f):
                a.weights[g], b.weights[g] = rank_tensors(a.path / f), rank_tensors(b.path / f)
    pa, pb = a.plan["programs"], b.plan["programs"]
    out: dict[str, Any] = {
        "a": str(a.path),
        "b": str(b.path),
        "kinds": [a.kind, b.kind],
        "manifest": diff_fields(a.manifest, b.manifest, ignored=_MANIFEST_IGNORED) if a.manifest and b.manifest else {},
        "plan": diff_fields(
            {k: v for k, v in a.plan.items() if k not in _PLAN_IGNORED},
            {k: v for k, v in b.plan.items() if k not in _PLAN_IGNORED},
        ),
        "programs": {
            name: diff_program(pa[name]["nodes"], pb[name]["nodes"])
            for name in sorted(pa, key=lambda p: (p != "prefill", p))
            if name in pb
        },
        "programs_removed": sorted(pa.keys() - pb.keys()),
        "programs_added": sorted(pb.keys() - pa.keys()),
        "weights": {g: diff_weights(a.weights[g], b.weights[g]) for g in a.weights if g in b.weights},
        "weight_groups_removed": sorted(a.weights.keys() - b.weights.keys()),
        "weight_groups_added": sorted(b.weights.keys() - a.weights.keys()),
    }
    if a.kind != b.kind:  # rank tensors and weight recipes do not compare
        out["weights"], out["weight_groups_removed"], out["weight_groups_added"] = {}, [], []
    out["identical"] = is_empty(out)
    return out


def is_empty(d: dict) -> bool:
    progs = all(not (p["replaced"] or p["added"] or p["removed"] or p["changed"]) for p in d["programs"].values())
    weights = all(not (w["added"] or w["removed"] or w["changed"]) for w in d["weights"].values())
    return (
        progs
        and weights
        and not d["manifest"]
        and not d["plan"]
        and not d["programs_removed"]
        and not d["programs_added"]
        and not d["weight_groups_removed"]
        and not d["weight_groups_added"]
    )


def mentioned_names(d: dict) -> set[str]:
    """Every node and weight name the diff reports (for scripts and tests)."""
    names = set()
    for p in d["programs"].values():
        names |= {r["a"]["name"] for r in p["replaced"]} | {r["b"]["name"] for r in p["replaced"]}
        names |= {n["name"] for k in ("added", "removed", "changed") for n in p[k]}
    for w in d["weights"].values():
        names |= {n["name"] for k in ("added", "removed", "changed") for n in w[k]}
    return names


# -- text ------------------------------------------------------------------------------------
def _ty(n: dict) -> str:
    if "dtype" in n:
        return f"{n['dtype']}{n.get('shape')}"
    return ""


def _what(n: dict) -> str:
    return n.get("op") or (f"weight({n['target']})" if n.get("kind") == "weight" else n.get("kind", ""))


def _short(v: Any, width: int = 70) -> str:
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else v
    return s if len(s) <= width else s[: width - 3] + "..."


def console():
    """Colours on a terminal; plain and wide enough for node names when piped."""
    from rich.console import Console

    c = Console(highlight=False, soft_wrap=True)
    if not c.is_terminal:
        c = Console(highlight=False, soft_wrap=True, width=200)
    return c


def render(d: dict, out=None) -> None:
    """Readable text; coloured when the console is a terminal."""
    from rich.markup import escape
    from rich.table import Table

    c = out or console()
    c.print(f"[bold]--- a: {escape(d['a'])}[/bold]  ({d['kinds'][0]})")
    c.print(f"[bold]+++ b: {escape(d['b'])}[/bold]  ({d['kinds'][1]})")
    if d["identical"]:
        c.print("[green]identical[/green]")
        return
    for title, fields in (("manifest", d["manifest"]), ("plan", d["plan"])):
        if fields:
            c.print(f"[bold]{title}:[/bold]")
            for k, (va, vb) in fields.items():
                c.print(f"  [yellow]~[/yellow] {escape(k)}: {escape(_short(va))} -> {escape(_short(vb))}")
    for name in d["programs_removed"]:
        c.print(f"[red]- program {name}[/red]")
    for name in d["programs_added"]:
        c.print(f"[green]+ program {name}[/green]")
    for name, p in d["programs"].items():
        n = sum(len(p[k]) for k in ("replaced", "added", "removed", "changed"))
        if not n:
            c.print(f"[bold]program {name}:[/bold] same")
            continue
        c.print(
            f"[bold]program {name}:[/bold] {len(p['replaced'])} replaced, {len(p['added'])} added, "
            f"{len(p['removed'])} removed, {len(p['changed'])} changed; calls {p['calls'][0]} -> {p['calls'][1]}"
        )
        for r in p["replaced"]:
            a, b = r["a"], r["b"]
            c.print(
                f"  [yellow]~[/yellow] {escape(a['name'])} -> [cyan]{escape(b['name'])}[/cyan]  "
                f"{escape(_what(a))} -> {escape(_what(b))}  {_ty(b)}"
            )
        for x in p["removed"]:
            c.print(f"  [red]-[/red] {escape(x['name'])}  {escape(_what(x))}  {_ty(x)}")
        for x in p["added"]:
            c.print(f"  [green]+[/green] {escape(x['name'])}  {escape(_what(x))}  {_ty(x)}")
        for x in p["changed"]:
            c.print(f"  [yellow]*[/yellow] {escape(x['name'])}  ({', '.join(x['fields'])})")
            c.print(f"      [red]- {escape(x['lines'][0])}[/red]")
            c.print(f"      [green]+ {escape(x['lines'][1])}[/green]")
            if x["lines"][0] == x["lines"][1]:  # e.g. a kernel's launch config: not in the line
                for f, (va, vb) in x["fields"].items():
                    c.print(f"      {f}: {escape(_short(va, 200))} -> {escape(_short(vb, 200))}")
        if p["op_counts"]:
            t = Table(title=f"program {name}: op counts that differ", title_justify="left")
            t.add_column("op")
            t.add_column("a", justify="right")
            t.add_column("b", justify="right")
            for op, (na, nb) in p["op_counts"].items():
                t.add_row(op, str(na), str(nb))
            t.add_row("[bold]all calls[/bold]", str(p["calls"][0]), str(p["calls"][1]))
            c.print(t)
    for g in d["weight_groups_removed"]:
        c.print(f"[red]- weights {g}[/red]")
    for g in d["weight_groups_added"]:
        c.print(f"[green]+ weights {g}[/green]")
    for g, w in d["weights"].items():
        if not (w["added"] or w["removed"] or w["changed"]):
            continue
        c.print(
            f"[bold]weights {g}:[/bold] {len(w['added'])} added, {len(w['removed'])} removed, "
            f"{len(w['changed'])} changed"
        )
        for x in w["removed"]:
            c.print(f"  [red]-[/red] {escape(x['name'])}  {_weight_ty(x)}")
        for x in w["added"]:
            c.print(f"  [green]+[/green] {escape(x['name'])}  {_weight_ty(x)}")
        for x in w["changed"]:
            c.print(
                f"  [yellow]*[/yellow] {escape(x['name'])}  "
                + "; ".join(
                    f"{f}: {escape(_short(_hash12(va)))} -> {escape(_short(_hash12(vb)))}"
                    for f, (va, vb) in x["fields"].items()
                )
            )


def _weight_ty(w: dict) -> str:
    if "sources" in w:  # a recipe
        return _short({k: v for k, v in w.items() if k != "name"}, 100)
    return f"{w['dtype']}{w['shape']}"


def _hash12(v: Any) -> Any:
    return v[:12] if isinstance(v, str) and len(v) == 64 else v
