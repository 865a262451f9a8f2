"""Pipeline parallelism: a program cut into stages of consecutive layers, one stage per group of
tensor-parallel ranks, activations passed between stages with torch.distributed send/recv.

    engine = load(art, pipeline_parallel_size=2)     # under torchrun: world = tp x pp ranks

A load-time choice over the same artifact: `split_layers` assigns the numbered layers to stages,
contiguous and balanced by weight bytes (the embedding counted in the first stage, the head in
the last: a step's time on a stage follows the bytes it reads); `stage_program` cuts a program's
node list (plan.json's form) for one stage. Each node goes to the stage of the layer its name
names (`model.layers.3.self_attn...`), or later when an input comes from a later stage (a
fused residual add named for the layer before); a node outside the layers that reads only the
step's inputs and weights (the embedding, rotary tables) is computed by every stage that needs
it, never sent. Values made on an earlier stage and read on this one or a later one arrive
as extra inputs (`recv_<i>`, in node order) from the stage before, and the stage hands the next
one what it and the stages after it read; the last stage's output is the program's (the
logits). Global rank g is stage g // tp, tensor-parallel rank g % tp; it reads rank file
g % tp, only the tensors its stage reads, and its KV pool holds only its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsc.errors import UserError
from dsc.runtime.checks import is_int
from dsc.runtime.memory_plan import node_refs
from dsc.runtime.offload import layer_of


@dataclass(frozen=True)
class StageProgram:
    nodes: list[dict]  # plan.json's node form: the original inputs, recv_<i>, weights, calls, output
    recv: tuple[tuple[str, str], ...]  # (value, dtype) arriving from the stage before, in order
    send: tuple[str, ...]  # values handed to the stage after (empty on the last stage)
    weights: frozenset[str]
    layers: frozenset[str]  # the numbered layers it computes


def check_pipeline_parallel_size(pp) -> None:
    """--pipeline-parallel-size as one UserError line (checked before any rank starts)."""
    if not is_int(pp) or not 1 <= pp <= 64:
        raise UserError(f"--pipeline-parallel-size: expected an integer 1..64, got {pp!r}")


def check_stages(plan: dict, pp: int, where: str = "plan.json") -> None:
    """pp stages fit the artifact: a decoder with at least pp layers (one UserError line)."""
    check_pipeline_parallel_size(pp)
    if pp == 1:
        return
    kind = plan["model"].get("kind", "decoder")
    if kind != "decoder" or "ragged" not in plan["programs"]:
        raise UserError(f"--pipeline-parallel-size: only decoders run in pipeline stages ({where} is an {kind})")
    n = len(program_layers(plan["programs"]["ragged"]["nodes"]))
    if pp > n:
        raise UserError(f"--pipeline-parallel-size: {pp} stages for {n} layers; give 1..{n}")


def program_layers(nodes: list[dict]) -> list[str]:
    """The numbered layers a program's call nodes name, in order of first appearance."""
    seen: dict[str, None] = {}
    for n in nodes:
        if n["kind"] == "call":
            layer = layer_of(n["name"] + ".")
            if layer is not None:
                seen.setdefault(layer, None)
    return list(seen)


def split_layers(nodes: list[dict], header: dict, pp: int) -> dict[str, int]:
    """Layer name -> stage: pp contiguous runs whose weight bytes (the first stage's with the
    weights read before the first layer, the last's with those read after the last) are as even
    as cuts between layers allow."""
    layers = program_layers(nodes)
    size = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    per_layer = dict.fromkeys(layers, 0)
    for name, n in size.items():
        layer = layer_of(name)
        if layer in per_layer:
            per_layer[layer] += n
    position = {n["name"]: i for i, n in enumerate(nodes)}
    first_layer = min(position[n["name"]] for n in nodes if n["kind"] == "call" and layer_of(n["name"] + "."))
    last_layer = max(position[n["name"]] for n in nodes if n["kind"] == "call" and layer_of(n["name"] + "."))
    readers: dict[str, list[int]] = {}
    weight_of = {n["name"]: n["target"] for n in nodes if n["kind"] == "weight"}
    for n in nodes:
        if n["kind"] == "call":
            for ref in _reads(n):
                if ref in weight_of:
                    readers.setdefault(weight_of[ref], []).append(position[n["name"]])
    front = sum(size.get(w, 0) for w, at in readers.items() if layer_of(w) is None and max(at) < first_layer)
    back = sum(size.get(w, 0) for w, at in readers.items() if layer_of(w) is None and min(at) > last_layer)
    loads = [per_layer[k] for k in layers]
    loads[0] += front
    loads[-1] += back
    cuts = _balanced_cuts(loads, pp)
    out, stage = {}, 0
    for i, k in enumerate(layers):
        while stage + 1 < pp and i >= cuts[stage]:
            stage += 1
        out[k] = stage
    return out


def _balanced_cuts(loads: list[int], parts: int) -> list[int]:
    """Indices where parts 1.. begin: contiguous parts minimizing the largest part's sum."""
    n = len(loads)
    prefix = [0]
    for x in loads:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[p][i]: the smallest largest sum splitting loads[:i] into p parts; at[p][i] where the last begins
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    at = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for i in range(p, n - (parts - p) + 1):
            for j in range(p - 1, i):
                v = max(best[p - 1][j], prefix[i] - prefix[j])
                if v < best[p][i]:
                    best[p][i], at[p][i] = v, j
    cuts, i = [], n
    for p in range(parts, 0, -1):
        i = at[p][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def _reads(node: dict) -> list[str]:
    """The nodes a plan node's args and kwargs refer to."""
    return node_refs(node.get("args")) + node_refs(list((node.get("kwargs") or {}).values()))


def _rename(a, names: dict[str, str]):
    if isinstance(a, list):
        return [_rename(x, names) for x in a]
    if isinstance(a, dict):
        if set(a) == {"node"}:
            return {"node": names.get(a["node"], a["node"])}
        return {k: _rename(v, names) for k, v in a.items()}
    return a


REPLICATED = -1


def stage_of_nodes(nodes: list[dict], layer_stage: dict[str, int]) -> dict[str, int]:
    """Each input, weight and call node's stage (REPLICATED: computed by every stage that reads it)."""
    last = max(layer_stage.values())
    stage: dict[str, int] = {}
    for n in nodes:
        kind = n["kind"]
        if kind in ("input", "weight"):
            stage[n["name"]] = REPLICATED
        elif kind == "call":
            deps = [stage[r] for r in _reads(n) if r in stage]
            after = max(deps, default=REPLICATED)
            if n.get("op") == "operator.getitem":  # a tuple's items stay with it
                stage[n["name"]] = after
                continue
            layer = layer_of(n["name"] + ".")
            own = layer_stage[layer] if layer in layer_stage else REPLICATED
            s = max(own, after)
            if s == REPLICATED and layer is not None:  # a layer's node that reads no layer output
                s = own
            stage[n["name"]] = s
        else:
            for r in node_refs(n.get("args")):
                if stage.get(r, REPLICATED) not in (REPLICATED, last):
                    raise UserError(f"pipeline: the program's output {r!r} is made before the last stage")
    return stage


def stage_program(nodes: list[dict], layer_stage: dict[str, int], s: int) -> StageProgram:
    """Stage s's program: what it computes, receives and sends (module docstring)."""
    last = max(layer_stage.values())
    stage = stage_of_nodes(nodes, layer_stage)
    by_name = {n["name"]: n for n in nodes if n["kind"] != "output"}
    output = next(n for n in nodes if n["kind"] == "output")
    users: dict[str, list[str]] = {}  # value -> the nodes reading it ("output" for the program's)
    for n in nodes:
        for r in _reads(n):
            users.setdefault(r, []).append(n["name"] if n["kind"] != "output" else "output")

    def reader_stage(u: str) -> int:
        return last if u == "output" else stage[u]

    def crosses_into(v: str, t: int) -> bool:
        """v, made before stage t, is read on stage t or later."""
        return (
            stage[v] != REPLICATED
            and stage[v] < t
            and any(reader_stage(u) >= t for u in users.get(v, []) if reader_stage(u) != REPLICATED)
        )

    order = [n["name"] for n in nodes if n["kind"] == "call"]
    recv = [v for v in order if crosses_into(v, s)]
    send = [v for v in order if s < last and crosses_into(v, s + 1)]
    own = [v for v in order if stage[v] == s]
    need: set[str] = set(own) | set(send) - set(recv)
    if s == last:
        need |= {r for r in node_refs(output.get("args")) if r not in recv}
    todo = list(need)
    while todo:  # the replicated nodes (and weights, inputs) the stage's nodes read
        v = todo.pop()
        for r in _reads(by_name[v]):
            if r in recv or r in need:
                continue
            if stage[r] == REPLICATED or by_name[r]["kind"] != "call":
                need.add(r)
                todo.append(r)
            elif stage[r] != s:
                raise UserError(f"pipeline: stage {s} reads {r!r} of stage {stage[r]} that is not handed over")
    for v in recv:
        if by_name[v].get("dtype") not in _DTYPES:
            raise UserError(
                f"pipeline: {v!r} ({by_name[v].get('dtype')}) crosses from stage {stage[v]} to {s} and is not "
                "a tensor this runtime sends; run this artifact without pipeline stages"
            )
    names = {v: f"recv_{i}" for i, v in enumerate(recv)}
    out: list[dict] = [n for n in nodes if n["kind"] == "input"]
    out += [
        {"kind": "input", "name": names[v], "dtype": by_name[v].get("dtype"), "shape": by_name[v].get("shape")}
        for v in recv
    ]
    out += [n for n in nodes if n["kind"] == "weight" and n["name"] in need]
    for n in nodes:
        if n["kind"] == "call" and n["name"] in need:
            out.append({**n, "args": _rename(n.get("args"), names), "kwargs": _rename(n.get("kwargs", {}), names)})
    if s == last:
        out.append({**output, "args": _rename(output.get("args"), names)})
    else:
        out.append({"kind": "output", "name": "output", "args": [{"node": names.get(v, v)} for v in send]})
    weights = frozenset(n["target"] for n in out if n["kind"] == "weight")
    layers = frozenset(k for k, t in layer_stage.items() if t == s)
    return StageProgram(out, tuple((v, by_name[v]["dtype"]) for v in recv), tuple(send), weights, layers)


def kv_pool_layers(sp: StageProgram) -> list[int]:
    """The KV-pool layer indices the stage's program reads (`kv_pool.<i>.k|v` weights)."""
    return sorted({int(w.split(".")[1]) for w in sp.weights if w.startswith("kv_pool.")})


_DTYPES = ("float32", "bfloat16", "float16", "int64", "int32", "int8", "uint8", "bool", "float8_e4m3fn")
_HEADER = 8  # int64s: ndim, dtype code, up to 6 dims


def send_tensor(t, dst: int, wait: bool = True) -> list:
    """t to global rank dst (through the communication device), its shape and dtype first.
    wait=False: returns the sends in flight, [(work, tensor)], to keep until they complete."""
    import torch
    import torch.distributed as dist

    from dsc.runtime.distributed import comm_device

    dev = comm_device()
    header = torch.zeros(_HEADER, dtype=torch.long)
    header[0], header[1] = t.dim(), _DTYPES.index(str(t.dtype).removeprefix("torch."))
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.long)
    out = []
    for x in (header.to(dev), t.contiguous().to(dev)):
        if wait:
            dist.send(x, dst)
        else:
            out.append((dist.isend(x, dst), x))
    return out


def broadcast_in(t, group):
    """Global rank 0's 1-D int64 tensor t to every rank of `group` (its stage's); the others
    pass None and get it."""
    import torch
    import torch.distributed as dist

    from dsc.runtime.distributed import comm_device

    dev = comm_device()
    size = torch.tensor([t.numel() if t is not None else 0], dtype=torch.long, device=dev)
    dist.broadcast(size, src=0, group=group)
    buf = t.to(dev) if t is not None else torch.empty(int(size.item()), dtype=torch.long, device=dev)
    dist.broadcast(buf, src=0, group=group)
    return buf


def recv_tensor(src: int, device):
    """A tensor `send_tensor` sent from global rank src, on `device`."""
    import torch
    import torch.distributed as dist

    from dsc.runtime.distributed import comm_device

    dev = comm_device()
    header = torch.zeros(_HEADER, dtype=torch.long, device=dev)
    dist.recv(header, src)
    h = header.tolist()
    t = torch.empty(h[2 : 2 + h[0]], dtype=getattr(torch, _DTYPES[h[1]]), device=dev)
    dist.recv(t, src)
    return t.to(device)


def tp_groups(tp: int, pp: int, rank: int):
    """Every stage's group of tensor-parallel ranks (made on every rank, in the same order, as
    torch.distributed asks); returns this rank's (None with tp == 1: no collectives run)."""
    import torch.distributed as dist

    mine = None
    for s in range(pp):
        ranks = list(range(s * tp, (s + 1) * tp))
        g = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            mine = g
    return mine
