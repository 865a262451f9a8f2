"""--auto-precision DB: a precision per linear layer, the cheapest that keeps the logits' SQNR
against the unquantized model at or above DB on the quantization report's own inputs.

The ladder, cheapest first: int4 (W4A16, groups of 128/64/32 as `--int4` picks them), int8
(W8A16, one scale per output channel), the compute dtype. fp8 is not a rung: at int8's bytes
it also rounds the activations, so on quality W8A16 is at least as good.

    1. sensitivity: the run of the unquantized prefill program (compiler/simulate.py) on the
       report's prompts that gives the reference logits also records every candidate linear's
       inputs x (up to SAMPLE_ROWS tokens);
       a layer's cost of a rung is its relative output error |x (W - Q(W))^T|^2 / |x W^T|^2.
    2. start with every layer at int4; measure the logits' SQNR of that assignment (the program
       run with each weight replaced by its dequantized rounding: in fp32 what the quantized
       program computes, up to the order of sums).
    3. while below DB: take the noise as proportional to the sum of the layers' costs (the
       factor from the last measurement), and move layers one rung up, best cost saved per byte
       first, until that sum predicts DB with MARGIN to spare (at least one move); measure again.
--calibrate does not apply (its prompts are the int8 report's; the options refuse it here).
The choice is recorded in the plan's notes ("auto_precision": target, measured rounds, one
scheme per layer) and the report prints the counts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from dsc.compiler.ir import Model
from dsc.compiler.weights import local_shape

SAMPLE_ROWS = 256  # input tokens kept per linear for its sensitivity
KEEP_BYTES = 4 << 30  # fp32 weight copies kept across the selection's runs, at most
MARGIN_DB = 1.0  # a move round aims this far above the target
LADDER = ("int4", "int8", None)  # None: the compute dtype


def int4_group(inp: int, given: int | None, gguf_blocks: bool = False) -> int | None:
    """--int4's group size for a layer of `inp` local input features (None: none fits): the
    given one, else 32 for a weight a GGUF file stores in 4-bit blocks of 32, else the largest
    of 128, 64, 32 dividing it."""
    order = [given] if given else [32] if gguf_blocks else [128, 64, 32]
    return next((g for g in order if inp % g == 0), None)


def gguf_blocks(model: Model, name: str) -> bool:
    """Whether every source of weight `name` is a GGUF tensor in 4-bit blocks of 32."""
    g = model.checkpoint.gguf
    return g is not None and all(g.four_bit_blocks(s) for s in model.weights[name].sources)


def layer_group(model: Model, name: str) -> int | None:
    """int4_group of a weight of the model."""
    inp = local_shape(model.weights[name], model.options.tp)[1]
    return int4_group(inp, model.options.int4_group_size, gguf_blocks(model, name))


def _rounded(w: torch.Tensor, scheme: str, group: int | None) -> torch.Tensor:
    """w [N, K] fp32 -> its dequantized rounding under a scheme, fp32."""
    if scheme == "int4":
        from dsc.kernels import int4

        assert group is not None  # choose offers int4 only where a group size fits
        p = int4.quantize_weight(w, group)
        return int4.dequantize_weight(p["qweight"], p["scale"], p["min"])
    from dsc.kernels import int8

    p = int8.quantize_weight(w, None, True)
    return int8.dequantize_weight(p["qweight"], p["scale"])


def _local(spec, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A rank's slice of a full [out, in] tensor, as the spec's shard cuts it."""
    if spec.shard is None or world == 1:
        return full
    ranges = spec.shard.ranges(rank, world)
    return torch.cat([full.narrow(spec.shard.dim, a, b - a) for a, b in ranges], spec.shard.dim).contiguous()


def choose(model: Model, targets: list[str], db: float) -> tuple[dict[str, str | None], dict]:
    """{weight name: "int4" | "int8" | None} for the candidate linears, and what was measured."""
    from dsc.compiler.sample_text import POSITIONS, report_inputs
    from dsc.compiler.simulate import Simulator, weight_bytes
    from dsc.compiler.weights import SourceReader, float_tensor, local_columns
    from dsc.kernels.int8 import sqnr_db

    opts, world = model.options, model.options.tp
    prompts, source = report_inputs(model.checkpoint.root, model.config["vocab_size"], opts.max_seq)
    groups = {n: layer_group(model, n) for n in targets}
    ladder = {n: [s for s in LADDER if s != "int4" or groups[n]] for n in targets}
    full_specs = {n: dataclasses.replace(model.weights[n], shard=None, dtype="float32") for n in targets}
    index = {
        n: [local_columns(model.weights[n], torch.arange(model.weights[n].shape[1]), r, world) for r in range(world)]
        for n in targets
    }
    xs: dict[str, torch.Tensor] = {}

    def observe(node, rank, args):  # a linear of a candidate weight (in the copy logits_at runs)
        name = getattr(node.args[1], "target", None) if len(node.args) > 1 else None
        if name not in groups or not isinstance(node.args[1], fx.Node) or node.args[1].op != "get_attr":
            return
        x = args[0].float().reshape(-1, args[0].shape[-1])
        step = max(1, x.shape[0] // SAMPLE_ROWS)
        x = x[::step][:SAMPLE_ROWS]
        full = xs.setdefault(name, torch.zeros(x.shape[0], model.weights[name].shape[1]))
        full[:, index[name][rank]] = x

    # the runs' weights kept across runs when they fit (the rounded variants of each candidate too)
    memo: dict[tuple, torch.Tensor] = {}
    keep = 3 * weight_bytes(model) * 4 <= KEEP_BYTES  # fp32 copies: the weights, and two rungs of the candidates

    with SourceReader(model.checkpoint) as reader:

        def full(n: str, scheme: str | None) -> torch.Tensor:
            key = ("full", n, scheme)
            if key in memo:
                return memo[key]
            t = (
                float_tensor(full_specs[n], 0, 1, reader)
                if scheme is None
                else _rounded(full(n, None), scheme, groups[n])
            )
            if keep:
                memo[key] = t
            return t

        def run(assign: dict[str, str | None], observer=None) -> torch.Tensor:
            made: dict[str, torch.Tensor] = {}

            def produce(n: str, r: int) -> torch.Tensor:
                scheme = assign.get(n)
                if scheme is None:
                    key = ("rank", n, r)
                    if key not in memo:
                        t = float_tensor(model.weights[n], r, world, reader)
                        if not keep:
                            return t
                        memo[key] = t
                    return memo[key]
                if n not in made:
                    made[n] = full(n, scheme)
                return _local(model.weights[n], made[n], r, world)

            sim = Simulator(
                model,
                produce,
                world,
                batch=len(prompts),
                seq=max(2, max(map(len, prompts))),
                weight_bytes=weight_bytes(model),
                dtype=torch.float32,
            )
            return sim.logits_at(prompts, POSITIONS, observer)

        ref = run({}, observe)  # and every candidate's inputs
        cost: dict[str, dict] = {}
        for n in targets:
            w = full(n, None)
            base = float((xs[n] @ w.T).pow(2).sum()) or 1.0
            cost[n] = {
                s: (0.0 if s is None else float((xs[n] @ (w - full(n, s)).T).pow(2).sum()) / base) for s in ladder[n]
            }
        nbytes = {n: _bytes(model.weights[n].shape, groups[n]) for n in targets}
        assign = {n: ladder[n][0] for n in targets}
        rounds = []
        while True:
            got = sqnr_db(ref, run(assign))
            rounds.append({"sqnr_db": round(min(got, 999.0), 3), "counts": _counts(assign)})  # 999: exact
            if got >= db or all(s is None for s in assign.values()):
                break
            total = sum(cost[n][assign[n]] for n in targets)
            want = total * 10 ** ((got - db - MARGIN_DB) / 10)  # the cost sum that predicts DB + MARGIN
            moved = False
            while total > want or not moved:
                best = None
                for n in targets:
                    rung = ladder[n].index(assign[n])
                    if rung + 1 < len(ladder[n]):
                        nxt = ladder[n][rung + 1]
                        gain = (cost[n][assign[n]] - cost[n][nxt]) / max(1, nbytes[n][nxt] - nbytes[n][assign[n]])
                        if best is None or gain > best[0]:
                            best = (gain, n, nxt)
                if best is None:
                    break
                _, n, nxt = best
                total += cost[n][nxt] - cost[n][assign[n]]
                assign[n], moved = nxt, True
    return assign, {"target_db": db, "inputs": source, "rounds": rounds}


def _bytes(shape: tuple[int, ...], group: int | None) -> dict[str | None, int]:
    out, inp = shape
    b = {"int8": out * inp + 4 * out, None: 2 * out * inp}
    if group:
        b["int4"] = out * inp // 2 + 4 * out * (inp // group)
    return b


def _counts(assign: dict[str, str | None]) -> dict[str, int]:
    out = {"int4": 0, "int8": 0, "16-bit": 0}
    for s in assign.values():
        out[s or "16-bit"] += 1
    return out


def summary_line(notes: dict) -> str:
    last = notes["rounds"][-1]
    c = last["counts"]
    return (
        f"auto-precision {notes['target_db']:g} dB: {c['int4']} int4, {c['int8']} int8, {c['16-bit']} 16-bit "
        f"linears; logits SQNR {last['sqnr_db']:.1f} dB after {len(notes['rounds'])} measured round"
        + ("s" if len(notes["rounds"]) > 1 else "")
    )
