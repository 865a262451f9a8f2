"""`dsc export-onnx ARTIFACT -o DIR`: each rank's prefill program as an ONNX model, rank{i}.onnx.

What the model is
  Inputs  input_ids [batch, seq] int64, position_ids [batch, seq] int64, cache_pos [batch]
          int64, last_idx [batch] int64, then kv_cache.<i>.k / kv_cache.<i>.v for every layer,
          each [max_batch, kv_heads, max_seq, head_dim] (the plan's KV-cache layout).
  Outputs logits [batch, vocab] (the token at last_idx), then kv_cache.<i>.k.next / .v.next:
          the caches with this step's keys and values written in.
  The KV cache is explicit state: pass zeros for a fresh sequence, feed the `.next` outputs
  back for the next step. The graph is the prefill program, exported with dynamic batch and
  seq (seq >= 1): seq = 1 with cache_pos = tokens so far is a decode step.

How it is built
  The plan's nodes are rebuilt into an FX graph (runtime/plan.py) and every dsc op is replaced
  by a decomposition in plain torch before `torch.onnx.export(dynamo=True)`:
  - an op that writes into its arguments (dsc.attention writes the KV cache) runs its
    `*_reference` on copies of those arguments and returns them; the copies become the
    cache outputs, and later readers see the written copy;
  - int8 linears: the weight enters as DequantizeLinear(qweight, scale[, zero]) (QDQ) feeding
    the 16-bit op they replaced (kernels/int8.py `linear_w8a16_qdq`);
  - dsc.all_reduce / dsc.all_gather (tp > 1) become com.microsoft AllReduce / AllGather, the
    collectives of onnxruntime's distributed (CUDA + NCCL) build: the only nodes outside the
    standard domain, and why a tp > 1 model is checked with onnx.checker only;
    dsc.all_reduce_add_rmsnorm becomes that AllReduce and the norm's reference,
    dsc.vocab_embedding_all_reduce_rmsnorm the lookup's reference, the AllReduce and the norm's;
  - any other dsc op: its plain-torch `<op>_reference` from dsc/kernels/<file>.py.
  Which of these an op takes is the `onnx` trait its kernel file declares (kernels/registry.py).
  `fp32=True` computes in float32 (weights upcast, dtype arguments rewritten): onnxruntime's
  CPU kernels have no bfloat16 arithmetic.

The check (on by default) runs onnx.checker, lists the ops, and for tp = 1 runs onnxruntime on
CPU against the dsc runtime on the same tokens: a prefill and one decode step from zero
caches. Pass: logits SQNR >= `tolerance_db` for the compute dtype (see TOLERANCE_DB).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import operator
import pkgutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from dsc.errors import UserError
from dsc.kernels.registry import DECLARED_OPS, KEEP, op_name, resolve_torch_op, traits

OPSET = 21  # DequantizeLinear with block_size (grouped int8 scales) needs 21
# onnxruntime (CPU) vs the dsc runtime (CPU): least logits SQNR in dB, by (artifact dtype, ONNX
# compute dtype). Same dtype: only the order of float operations differs (measured on the tiny
# test models: fp32 ~125 dB, fp16 ~57 dB). A bf16 artifact computed in fp32 differs by the bf16
# rounding of every activation in the dsc run (~40 dB; ~32 dB with W8A8, where that rounding
# flips some activations' int8 values). bf16 compute is not checked: onnxruntime's CPU kernels
# have no bf16 arithmetic.
TOLERANCE_DB = {
    ("float32", "float32"): 80.0,
    ("float16", "float16"): 40.0,
    ("float16", "float32"): 40.0,
    ("bfloat16", "float32"): 25.0,
}
# W8A8 in fp16: where the two runtimes' fp16 rounding differs, an activation's per-token int8
# value flips by one step; the tiny test models' logits then agree to 37-42 dB across prompts
W8A8_FP16_TOLERANCE_DB = 33.0


def tolerance_db(engine, fp32: bool) -> float | None:
    """The least logits SQNR the check accepts for this engine's artifact, or None (not run)."""
    dtypes = (_name(engine.dtype), "float32" if fp32 else _name(engine.dtype))
    if dtypes not in TOLERANCE_DB:
        return None
    options = engine.artifact.manifest.get("options") or {}
    if dtypes[0] == "float16" and options.get("int8") and options.get("int8_mode") == "w8a8":
        return W8A8_FP16_TOLERANCE_DB
    return TOLERANCE_DB[dtypes]


INPUTS = ("input_ids", "position_ids", "cache_pos", "last_idx")


# -- decompositions ------------------------------------------------------------------------
def reference_for(op: torch._ops.OpOverload) -> Callable:
    """The plain-torch `<op>_reference` a dsc op's kernel file defines."""
    import dsc.kernels

    name = f"{op._opname}_reference"
    for info in pkgutil.iter_modules(dsc.kernels.__path__):
        mod = importlib.import_module(f"dsc.kernels.{info.name}")
        if hasattr(mod, name):
            return getattr(mod, name)
    raise UserError(f"export-onnx: no plain-torch {name} in dsc/kernels for {op}; it cannot be decomposed")


def _mutated_args(op: torch._ops.OpOverload) -> list[int]:
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _functional(ref: Callable, mutated: list[int]) -> Callable:
    """ref(*args) on copies of the arguments it writes; returns (out, *written copies)."""

    def run(*args):
        args = list(args)
        for i in mutated:
            args[i] = args[i].clone()
        return (ref(*args), *(args[i] for i in mutated))

    run.__name__ = f"{ref.__name__}_functional"
    return run


# -- the module ----------------------------------------------------------------------------
def _to_fp32(a: Any) -> Any:
    return torch.float32 if isinstance(a, torch.dtype) and a in (torch.float16, torch.bfloat16) else a


def plan_module(
    nodes: list[dict], weights: dict[str, torch.Tensor], cache: dict[str, torch.Tensor], fp32: bool = False
) -> tuple[fx.GraphModule, list[str]]:
    """An exportable GraphModule of one program: standard torch ops only, the KV cache as
    inputs and outputs (forward(input_ids, position_ids, cache_pos, last_idx, *caches) ->
    (logits, *caches)). Returns it and the cache names in input order."""
    from dsc.runtime.plan import build_graph

    g, targets = build_graph(nodes, torch.device("cpu"))
    cache_names = [t for t in targets if t in cache]
    inputs: dict[str, fx.Node] = {}
    with g.inserting_after([n for n in g.nodes if n.op == "placeholder"][-1]):
        for t in reversed(cache_names):
            inputs[t] = g.placeholder(t.replace(".", "_"))
    for n in list(g.nodes):
        if n.op == "get_attr" and n.target in cache:
            n.replace_all_uses_with(inputs[n.target])
            g.erase_node(n)
    latest = {p: p for p in inputs.values()}  # a cache input -> the node holding its newest value
    for n in list(g.nodes):
        n.args = fx.map_arg(n.args, lambda a: latest.get(a, a))
        n.kwargs = fx.map_arg(n.kwargs, lambda a: latest.get(a, a))
        if fp32 and n.op == "call_function":
            n.args, n.kwargs = fx.node.map_aggregate(n.args, _to_fp32), fx.node.map_aggregate(n.kwargs, _to_fp32)
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or n.target.namespace != "dsc":
            continue
        new = _decompose(g, n)
        if new is n:
            continue
        written = _mutated_args(n.target)
        if written:
            with g.inserting_after(new):
                for i, arg in reversed(list(enumerate(written, start=1))):
                    latest[n.args[arg]] = g.call_function(operator.getitem, (new, i))
                new = g.call_function(operator.getitem, (new, 0))
        n.replace_all_uses_with(new)
        g.erase_node(n)
    out = next(n for n in g.nodes if n.op == "output")
    out.args = ((out.args[0], *(latest[inputs[t]] for t in cache_names)),)
    g.eliminate_dead_code()
    attrs = {
        t: (weights[t].float() if fp32 and weights[t].is_floating_point() else weights[t])
        for t in targets
        if t in weights
    }
    return fx.GraphModule(attrs, g), cache_names


def _decompose(g: fx.Graph, n: fx.Node) -> fx.Node:
    """The node's stand-in of standard ops, as the op's kernel file declares its ONNX form
    (kernels/registry.py `onnx`): n itself for an op kept as a node."""
    op = n.target
    fn = traits(op_name(op)).onnx
    if fn == KEEP:
        return n
    if fn is None:
        fn = reference_for(op)
        mutated = _mutated_args(op)
        fn = _functional(fn, mutated) if mutated else fn
    with g.inserting_before(n):
        return g.call_function(fn, n.args, n.kwargs)


# -- export --------------------------------------------------------------------------------
def _example_inputs(vocab: int, batch: int = 2, seq: int = 3) -> tuple[torch.Tensor, ...]:
    ids = torch.arange(batch * seq).reshape(batch, seq) % vocab
    pos = torch.arange(seq).expand(batch, seq).contiguous()
    return ids, pos, torch.zeros(batch, dtype=torch.long), torch.full((batch,), seq - 1)


def export_rank(
    gm: fx.GraphModule,
    cache_names: list[str],
    caches: list[torch.Tensor],
    limits: dict,
    vocab: int,
    path: Path,
    metadata: dict[str, str],
) -> None:
    from torch.export import Dim

    b, s = Dim("batch", min=1, max=limits["max_batch"]), Dim("seq", min=1, max=limits["max_seq"])
    dynamic = ({0: b, 1: s}, {0: b, 1: s}, {0: b}, {0: b}, *[None] * len(caches))
    table = {resolve_torch_op(name): t.onnx_translation for name, t in DECLARED_OPS.items() if t.onnx == KEEP}
    prog = torch.onnx.export(
        gm,
        (*_example_inputs(vocab), *caches),
        dynamo=True,
        dynamic_shapes=dynamic,
        input_names=[*INPUTS, *cache_names],
        output_names=["logits", *(f"{c}.next" for c in cache_names)],
        custom_translation_table=table,
        opset_version=OPSET,
        verbose=False,
    )
    prog.model.doc_string = __doc__.split("How it is built")[0].strip()  # the I/O contract, shown by Netron
    prog.model.metadata_props.update(metadata)
    prog.save(str(path))


def export_onnx(
    artifact: str | Path, out: str | Path, fp32: bool = False, check: bool = True, ranks: list[int] | None = None
) -> list[dict]:
    """Write DIR/rank{i}.onnx for every rank (or those in `ranks`); with `check`, verify each
    (see the module docstring). Returns one report per rank."""
    from dsc.runtime.artifact import open_artifact
    from dsc.runtime.engine import Engine

    for mod in ("onnx", "onnxscript") + (("onnxruntime",) if check else ()):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"export-onnx needs the {mod} package: pip install 'dsc[onnx]'")
    head = open_artifact(artifact, ranks=[], verify=False)
    tp = head.tp
    if (head.manifest.get("options") or {}).get("int4"):
        raise UserError(
            f"export-onnx: {head.path} has --int4 weights, which dsc does not export to ONNX "
            "(int8 and fp8 artifacts export)"
        )
    bad = [r for r in ranks or () if not 0 <= r < tp]
    if bad:
        raise UserError(f"export-onnx: rank {bad[0]} is out of range for tp={tp}")
    ranks = sorted(set(ranks)) if ranks else list(range(tp))
    art = open_artifact(artifact, ranks=ranks, verify=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = art.plan
    reports = []
    for r in ranks:
        engine = Engine(art, r, art.tp, torch.device("cpu"))  # weights and cache layout; no collectives run
        caches = {k: (v.float() if fp32 else v) for k, v in engine.kv_cache.items()}
        gm, cache_names = plan_module(plan["programs"]["prefill"]["nodes"], engine.weights, caches, fp32)
        path = out / f"rank{r}.onnx"
        meta = {
            "dsc.artifact": str(art.path),
            "dsc.program": "prefill",
            "dsc.rank": str(r),
            "dsc.tp": str(art.tp),
            "dsc.kv_cache": json.dumps(plan["kv_cache"], sort_keys=True),
            "dsc.compute_dtype": "float32" if fp32 else plan["model"]["dtype"],
        }
        _quiet(
            export_rank,
            gm,
            cache_names,
            [caches[c] for c in cache_names],
            plan["limits"],
            plan["model"]["vocab_size"],
            path,
            meta,
        )
        report = {"path": str(path), "rank": r}
        if check:
            report.update(check_model(path, engine if art.tp == 1 else None, fp32))
        reports.append(report)
    return reports


def _quiet(fn: Callable, *args) -> Any:
    """torch.onnx prints progress to stdout and logs warnings about optional packages; keep the
    command's output to its report."""
    import contextlib
    import io
    import logging
    import warnings

    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)
    finally:
        log.setLevel(level)


# -- check ---------------------------------------------------------------------------------
def check_model(path: Path, engine=None, fp32: bool = False) -> dict:
    """onnx.checker, the ops used, and (given the rank's engine) onnxruntime vs the dsc runtime."""
    import onnx

    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    ops = sorted({f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in model.graph.node})
    res: dict[str, Any] = {"nodes": len(model.graph.node), "ops": ops, "nonstandard_ops": [o for o in ops if "." in o]}
    if engine is not None:
        dtypes = (_name(engine.dtype), "float32" if fp32 else _name(engine.dtype))
        tol = tolerance_db(engine, fp32)
        if tol is not None:
            res.update(compare_with_runtime(path, engine, fp32), tolerance_db=tol)
            res["ok"] = all(
                res[p]["sqnr_db"] is None or res[p]["sqnr_db"] >= res["tolerance_db"] for p in ("prefill", "decode")
            )
        else:
            res["not_run"] = f"onnxruntime's CPU kernels have no {dtypes[1]} arithmetic; --fp32 computes in float32"
    return res


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compare_with_runtime(path: Path, engine, fp32: bool = False) -> dict:
    """Prefill of two prompts (6 and 2 tokens) and one decode step, from zero caches, in
    onnxruntime (CPU) and the dsc runtime; logits SQNR and max abs error."""
    import onnxruntime as ort

    from dsc.compiler.numerics import sqnr_db
    from dsc.compiler.verify import sample_prompts

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cache_names = [i.name for i in sess.get_inputs()][len(INPUTS) :]
    prompts = sample_prompts(engine.vocab_size, batch=2, max_len=6)
    engine.reset()
    ref = [engine.prefill(prompts)]
    lens = torch.tensor([len(p) for p in prompts])
    nxt = ref[0].argmax(-1)
    ref.append(engine.decode(nxt, lens))
    engine.reset()
    L = len(prompts[0])
    ids = torch.tensor([p + [0] * (L - len(p)) for p in prompts])
    pos = torch.arange(L).expand(2, L).contiguous()
    dtype = torch.float32 if fp32 else engine.dtype
    caches = [torch.zeros_like(engine.kv_cache[c], dtype=dtype).numpy() for c in cache_names]
    feeds = [ids, pos, torch.zeros(2, dtype=torch.long), lens - 1]
    got = sess.run(None, {**dict(zip(INPUTS, (t.numpy() for t in feeds))), **dict(zip(cache_names, caches))})
    step = [nxt[:, None], lens[:, None], lens, torch.zeros(2, dtype=torch.long)]
    got2 = sess.run(None, {**dict(zip(INPUTS, (t.numpy() for t in step))), **dict(zip(cache_names, got[1:]))})
    res: dict[str, Any] = {}
    for name, a, b in (("prefill", ref[0], got[0]), ("decode", ref[1], got2[0])):
        b = torch.from_numpy(b).float()
        res[name] = {"max_abs_err": float((b - a).abs().max()), "sqnr_db": sqnr_db(a, b)}
    return res


def report_lines(reports: list[dict]) -> Iterator[str]:
    for r in reports:
        yield f"wrote {r['path']}"
        if "ops" not in r:
            continue
        yield f"  onnx.checker: ok; {r['nodes']} nodes, ops: {', '.join(r['ops'])}"
        if r["nonstandard_ops"]:
            yield f"  outside the standard domain: {', '.join(r['nonstandard_ops'])}"
        if "not_run" in r:
            yield f"  onnxruntime not run: {r['not_run']}"
        for p in ("prefill", "decode"):
            if p in r:
                db = r[p]["sqnr_db"]
                yield (
                    f"  onnxruntime vs dsc runtime, {p} logits: max abs err {r[p]['max_abs_err']:.3g}, "
                    f"SQNR {'exact' if db is None else f'{db:.1f} dB'} (need >= {r['tolerance_db']} dB)"
                )
