"""`dsc diff --numeric A B`: run two artifacts on the same tokens and compare every node they share.

Each artifact is loaded with the runtime (`dsc.load`, CPU), its KV cache zeroed, and the
program run under an `fx.Interpreter` that keeps a float32 copy of every node's output,
keyed by the node's stable plan name. Nodes are paired by the value they hold (`value_twins`): the node of the
same name, or the one that replaced it (an int8 `...q_proj.linear_w8a16` is compared with
the 16-bit `...q_proj.linear`), or the node B's readers read instead (the all-reduce after
a row-parallel linear). A is the reference: per shared call node,
max |b - a| and SQNR = 10 log10(sum a^2 / sum (b - a)^2) dB (None when b == a exactly).
The first node in A's program order below the SQNR threshold is where the two diverge.

Programs: "prefill" runs the prompts; "decode" runs prefill on all but each prompt's last
token (not recorded), then records one decode step of the last token.

Tensor parallel: an artifact with tp > 1 runs its ranks as gloo processes on this machine;
each records its rank-local values. Before comparing with a side of another layout, the
per-rank values of a node are put back together from shapes alone: equal on every rank ->
replicated (rank 0's); same shape but different -> partial sums before an all-reduce
(summed); one dim smaller by a whole factor -> sharded: the ranks' pieces concatenated in
rank order, a piece held by several ranks (kv heads replicated when tp > kv heads) taken
once. A fused projection's output ([q | k | v] on every rank) is gathered block by block,
the blocks read off the `aten.slice` nodes that split it on each side. A node whose pieces
do not fit is listed as skipped, with the reason.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from dsc.compiler.diff import match_nodes, node_inputs
from dsc.compiler.verify import sample_prompts
from dsc.errors import UserError
from dsc.runtime.checks import check_token_ids

PROGRAMS = ("prefill", "decode")


class _Recorder(fx.Interpreter):
    """Runs a GraphModule node by node, keeping a float32 copy of every tensor a call (or the
    output) produces."""

    def __init__(self, gm: fx.GraphModule, names: dict[fx.Node, str], values: dict[str, torch.Tensor]):
        super().__init__(gm)
        self.names, self.values = names, values

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op in ("call_function", "output") and isinstance(out, torch.Tensor):
            self.values[self.names[n]] = out.detach().to(torch.float32, copy=True)
        return out


@contextlib.contextmanager
def _recording(engine, program: str, values: dict[str, torch.Tensor]):
    """Replace one of the engine's programs by a recording run of the same GraphModule."""
    gm = engine.programs[program]
    # build_graph makes one fx node per plan node, in plan order
    names = {n: p["name"] for n, p in zip(gm.graph.nodes, engine.plan["programs"][program]["nodes"])}
    engine.programs[program] = lambda *args: _Recorder(gm, names, values).run(*args)
    try:
        yield
    finally:
        engine.programs[program] = gm


def record(engine, prompts: Sequence[Sequence[int]], program: str = "prefill") -> dict[str, torch.Tensor]:
    """Every call node's output (float32) for one run of `program` from a fresh KV cache."""
    values: dict[str, torch.Tensor] = {}
    engine.reset()
    if program == "prefill":  # eager at the exact length: a recording run cannot be a CUDA graph
        with _recording(engine, "prefill", values):
            engine.prefill(prompts, graphs=False)
    else:
        engine.prefill([p[:-1] for p in prompts])
        last = torch.tensor([[p[-1]] for p in prompts], device=engine.device)  # [B, 1]
        pos = torch.tensor([len(p) - 1 for p in prompts], device=engine.device)  # [B]
        with _recording(engine, "decode", values):  # the program itself: no batch-bucket padding
            engine.run("decode", last, pos[:, None], pos, torch.zeros_like(pos))
    engine.reset()
    return values


def _rank_main(rank: int, world: int, init_file: str, path: str, prompts, program: str, out_dir: str) -> None:
    import torch.distributed as dist

    import dsc
    from dsc.runtime.distributed import shutdown_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        engine = dsc.load(path, device="cpu")
        torch.save(record(engine, prompts, program), Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        shutdown_process_group(barrier=False)
        raise
    shutdown_process_group()


def capture(
    path: str | Path, prompts: Sequence[Sequence[int]], program: str = "prefill", spawn: bool | None = None
) -> dict[str, list[torch.Tensor]]:
    """Node name -> its output on each rank. Ranks run as gloo processes when the artifact has
    tp > 1 (or `spawn` asks for it); otherwise in this process."""
    import dsc
    from dsc.runtime.artifact import open_artifact

    world = open_artifact(path, ranks=[], verify=False).tp
    if not (spawn if spawn is not None else world > 1):
        return {k: [v] for k, v in record(dsc.load(path, device="cpu"), prompts, program).items()}
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="dsc-numeric-") as d:
        mp.spawn(
            _rank_main,
            args=(world, str(Path(d) / "init"), str(path), [list(p) for p in prompts], program, d),
            nprocs=world,
            join=True,
        )
        ranks = [torch.load(Path(d) / f"rank{r}.pt") for r in range(world)]
    return {k: [r[k] for r in ranks] for k in ranks[0]}


# -- comparing -----------------------------------------------------------------------------
def slice_blocks(nodes: list[dict]) -> dict[str, list[int]]:
    """Node name -> sizes of the blocks that `aten.slice` readers cut its last dim into (a
    fused projection's [q | k | v] or [gate | up]), in order, for nodes read that way."""
    cuts: dict[str, list[tuple[int, int]]] = {}
    for n in nodes:
        if n.get("op") == "aten.slice.Tensor" and n["args"][1] == -1 and isinstance(n["args"][0], dict):
            cuts.setdefault(n["args"][0]["node"], []).append((n["args"][2], n["args"][3]))
    out = {}
    for name, c in cuts.items():
        c.sort()
        if c[0][0] == 0 and all(a[1] == b[0] for a, b in zip(c, c[1:])):
            out[name] = [hi - lo for lo, hi in c]
    return out


def gather(
    parts: list[torch.Tensor], shape: torch.Size, blocks: tuple[list[int], list[int]] | None = None
) -> tuple[torch.Tensor | None, str]:
    """One tensor of `shape` from per-rank values (see the module docstring), and how.
    `blocks`: (full, local) block sizes along the last dim for a fused projection's output,
    each block sharded on its own."""
    if len(parts) == 1:
        return (parts[0], "") if parts[0].shape == shape else (None, f"shape {list(parts[0].shape)} vs {list(shape)}")
    local, world = parts[0].shape, len(parts)
    if any(p.shape != local for p in parts):
        return None, "ranks hold different shapes"
    if local == shape:
        if all(torch.equal(p, parts[0]) for p in parts[1:]):
            return parts[0], "replicated"
        return torch.stack(parts).sum(0), "partial sums, summed"
    dims = [d for d in range(len(local)) if len(local) == len(shape) and local[d] != shape[d]]
    if len(dims) != 1:
        return None, f"rank shape {list(local)} does not gather into {list(shape)}"
    dim = dims[0]
    full_sizes, local_sizes = blocks if blocks and dim == len(local) - 1 else ([shape[dim]], [local[dim]])
    if (
        sum(full_sizes) != shape[dim]
        or sum(local_sizes) != local[dim]
        or len(full_sizes) != len(local_sizes)
        or any(f % n for f, n in zip(full_sizes, local_sizes))
    ):
        return None, f"rank shape {list(local)} does not gather into {list(shape)}"
    out, offset = [], 0
    for full, size in zip(full_sizes, local_sizes):
        pieces = full // size  # < world: ranks share pieces (kv heads replicated when tp > heads)
        for j in range(pieces):
            r = next(r for r in range(world) if r * pieces // world == j)  # first rank holding piece j
            out.append(parts[r].narrow(dim, offset, size))
        offset += size
    how = f"sharded on dim {dim}" + (f" in blocks {full_sizes}" if len(full_sizes) > 1 else "")
    return torch.cat(out, dim), how


def _pair(
    pa: list[torch.Tensor], pb: list[torch.Tensor], blocks_a: list[int] | None, blocks_b: list[int] | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    if len(pa) == len(pb) and all(x.shape == y.shape for x, y in zip(pa, pb)):
        return torch.stack(pa), torch.stack(pb), ""  # same layout: compare rank by rank
    if len(pb) > 1 and len(pa) == 1:
        b, how = gather(pb, pa[0].shape, (blocks_a, blocks_b) if blocks_a and blocks_b else None)
        return pa[0], b, how
    if len(pa) > 1 and len(pb) == 1:
        a, how = gather(pa, pb[0].shape, (blocks_b, blocks_a) if blocks_a and blocks_b else None)
        return a, pb[0], how
    return None, None, f"layouts differ ({len(pa)} vs {len(pb)} ranks)"


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float | None:
    """SQNR of x against ref in dB (dsc.kernels.int8.sqnr_db); None when x equals ref exactly."""
    from dsc.kernels.int8 import sqnr_db as sqnr

    db = sqnr(ref, x)
    return None if db == math.inf else db


def value_twins(nodes_a: list[dict], nodes_b: list[dict]) -> dict[str, str]:
    """A-name -> the B node that holds the same value. Usually the node of the same name (or
    its replacement, see diff.match_nodes); but where B's readers of that value read another
    node — an all-reduce after a row-parallel linear, a mask after a vocab-parallel
    embedding — the value to compare is that one. Taken from B only when every reader of the
    A node that both programs hold agrees on it, and only for floating-point values: integer
    ones a rank rewrites for itself (expert parallelism's local expert ids) are not the same
    value."""
    m = match_nodes(nodes_a, nodes_b)
    b_by = {n["name"]: n for n in nodes_b}
    read: dict[str, set[str]] = {}
    for an in nodes_a:
        if an["name"] in m:
            for x, y in zip(node_inputs(an), node_inputs(b_by[m[an["name"]]])):
                read.setdefault(x, set()).add(y)
    twins = dict(m)
    for x, ys in read.items():
        y = next(iter(ys))
        if len(ys) == 1 and y in b_by and not str(b_by[y].get("dtype", "float")).startswith(("int", "uint", "bool")):
            twins[x] = y
    return twins


def compare(
    nodes_a: list[dict],
    nodes_b: list[dict],
    va: dict[str, list[torch.Tensor]],
    vb: dict[str, list[torch.Tensor]],
    threshold: float,
) -> dict:
    m = value_twins(nodes_a, nodes_b)
    b_by = {n["name"]: n for n in nodes_b}
    blocks_a, blocks_b = slice_blocks(nodes_a), slice_blocks(nodes_b)
    rows, skipped = [], []
    for n in nodes_a:
        name = n["name"]
        if n["kind"] not in ("call", "output") or name not in m or name not in va or m[name] not in vb:
            continue
        a, b, how = _pair(va[name], vb[m[name]], blocks_a.get(name), blocks_b.get(m[name]))
        entry = {"a": name, "b": m[name], "op": b_by[m[name]].get("op", "output")}
        if a is None or b is None:
            skipped.append({**entry, "why": how})
            continue
        finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
        db = sqnr_db(a, b) if finite else None
        rows.append(
            {
                **entry,
                "shape": list(va[name][0].shape),
                "max_abs": float((b - a).abs().max()) if a.numel() else 0.0,
                "sqnr_db": db,
                "exact": finite and db is None,
                **({} if finite else {"nonfinite": True}),
                **({"gathered": how} if how else {}),
            }
        )
    below = [r for r in rows if r.get("nonfinite") or (r["sqnr_db"] is not None and r["sqnr_db"] < threshold)]
    scored = [r for r in rows if r["sqnr_db"] is not None]
    return {
        "nodes": rows,
        "skipped": skipped,
        "threshold_db": threshold,
        "first_divergent": below[0] if below else None,
        "worst": min(scored, key=lambda r: r["sqnr_db"]) if scored else None,
        "output": next((r for r in rows if r["a"] == "output"), None),
        "only_in_a": sum(1 for n in nodes_a if n["kind"] == "call" and n["name"] not in m),
        "only_in_b": len({n["name"] for n in nodes_b if n["kind"] == "call"} - set(m.values())),
    }


def numeric_diff(
    a: str | Path,
    b: str | Path,
    prompts: Sequence[Sequence[int]] | None = None,
    program: str = "prefill",
    threshold: float = 30.0,
    seed: int = 0,
    length: int = 8,
    spawn: bool | None = None,
) -> dict:
    """Run A and B on the same prompts (given, or one seeded random prompt of `length` tokens)
    and compare every node they share; see the module docstring."""
    from dsc.runtime.artifact import open_artifact

    if program not in PROGRAMS:
        raise UserError(f"--program: expected one of {', '.join(PROGRAMS)}, got {program!r}")
    arts = [open_artifact(p, ranks=[], verify=False) for p in (a, b)]
    vocab = min(x.plan["model"]["vocab_size"] for x in arts)
    max_seq = min(x.plan["limits"]["max_seq"] for x in arts)
    max_batch = min(x.plan["limits"]["max_batch"] for x in arts)
    prompts = [list(p) for p in prompts] if prompts else sample_prompts(vocab, batch=1, seed=seed, max_len=length)
    _check_prompts(prompts, vocab, max_seq, max_batch, program)
    va = capture(a, prompts, program, spawn)
    vb = capture(b, prompts, program, spawn)
    res = compare(
        arts[0].plan["programs"][program]["nodes"], arts[1].plan["programs"][program]["nodes"], va, vb, threshold
    )
    return {"a": str(a), "b": str(b), "program": program, "prompts": prompts, **res}


def _check_prompts(prompts: list[list[int]], vocab: int, max_seq: int, max_batch: int, program: str) -> None:
    if len(prompts) > max_batch:
        raise UserError(f"--token-ids: {len(prompts)} prompts, the artifacts hold a batch of {max_batch}")
    shortest = 2 if program == "decode" else 1
    for i, p in enumerate(prompts):
        if not shortest <= len(p) < max_seq:
            raise UserError(f"--token-ids: prompt {i} has {len(p)} tokens; {program} needs {shortest} to {max_seq - 1}")
        check_token_ids(p, vocab, "--token-ids")


# -- text ------------------------------------------------------------------------------------
def _db(r: dict) -> str:
    return "non-finite" if r.get("nonfinite") else "exact" if r["sqnr_db"] is None else f"{r['sqnr_db']:.1f}"


def _rank_key(r: dict) -> float:
    return -math.inf if r.get("nonfinite") else math.inf if r["exact"] else r["sqnr_db"]


def render(d: dict, top: int | None = None, out=None) -> None:
    from rich.markup import escape
    from rich.table import Table

    from dsc.compiler.diff import console

    c = out or console()
    rows = d["nodes"]
    if top:
        rows = sorted(rows, key=_rank_key)[:top]
    t = Table(
        title=f"{d['program']}: {len(d['nodes'])} shared nodes, a = {escape(d['a'])}, b = {escape(d['b'])}",
        title_justify="left",
    )
    for col, just in (
        ("node (a)", "left"),
        ("b", "left"),
        ("op (b)", "left"),
        ("max abs err", "right"),
        ("SQNR dB", "right"),
    ):
        t.add_column(col, justify=just, overflow="fold")
    for r in rows:
        low = r.get("nonfinite") or (r["sqnr_db"] is not None and r["sqnr_db"] < d["threshold_db"])
        style = "red" if low else ("green" if r["exact"] else "")
        t.add_row(
            escape(r["a"]),
            "" if r["b"] == r["a"] else escape(r["b"]),
            escape(r["op"]),
            f"{r['max_abs']:.3g}",
            _db(r),
            style=style,
        )
    c.print(t)
    for s in d["skipped"]:
        c.print(f"[yellow]skipped[/yellow] {escape(s['a'])}: {escape(s['why'])}")
    c.print(f"nodes only in a: {d['only_in_a']}, only in b: {d['only_in_b']}")
    if d["output"]:
        c.print(f"output (logits): max abs err {d['output']['max_abs']:.3g}, SQNR {_db(d['output'])} dB")
    if d["worst"]:
        w = d["worst"]
        c.print(f"worst node: {escape(w['a'])} ({escape(w['op'])}) SQNR {_db(w)} dB")
    f = d["first_divergent"]
    if f:
        c.print(
            f"[red]first divergence below {d['threshold_db']} dB:[/red] {escape(f['a'])} ({escape(f['op'])}) "
            f"SQNR {_db(f)} dB, max abs err {f['max_abs']:.3g}"
        )
    else:
        c.print(f"[green]no node below {d['threshold_db']} dB[/green]")
