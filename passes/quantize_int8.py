"""quantize_int8: linears of the transformer blocks -> dsc int8, fp8 or int4 linears over quantized weight parts.

Matches  aten.linear(x, W[, b]) with W a 2-D weight spec (whatever earlier passes made of it:
         a fused q/k/v or gate/up weight, a tensor-parallel shard), in every program.
Rewrites (each counted under `quantize_int8.<rule>`, per node)
  w8a16       -> dsc.linear_w8a16(x, W.qweight, W.scale, W.zero | None, b, group_size)
  w8a8        -> dsc.linear_w8a8(x, W.qweight, W.scale, W.zero | None, b, group_size, W.inv_smooth | None)
  fp8         (--fp8) -> dsc.linear_fp8(x, W.qweight, W.scale, b): e4m3 weights with one scale per
              output row, per-token e4m3 activations (kernels/fp8.py); the keep/skip rules below
              apply alike; experts stay 16-bit (no fp8 expert kernel)
  int4        (--int4) -> dsc.linear_w4a16(x, W.qweight, W.scale, W.min, b, group_size): 4-bit
              weights packed two to a byte, an fp16 scale and min per group of input features
              (kernels/int4.py): --int4-group-size G, which must divide the layer's local input
              features, else per layer 32 where a GGUF file stores the weight in 4-bit blocks of
              32 (Q4_0, Q4_1), else the largest of 128, 64, 32 that divides them; keep/skip rules
              as above; experts stay 16-bit
  auto        (--auto-precision DB) each linear int4, int8 (w8a16 per channel) or kept, as
              passes/auto_precision.py chooses: the cheapest meeting DB of logits SQNR
  keep_head   a linear outside the blocks (lm_head, or any linear on a weight an embedding
              also reads) stays in the compute dtype unless --int8-lm-head
  keep_router a mixture of experts' router stays in the compute dtype: its scores choose the
              experts, and an int8 error there changes which experts run, not only their sum
  skip        the module path (the weight name minus ".weight", any of its checkpoint sources,
              or the node's HF module path) matches an --int8-skip fnmatch pattern; a fused
              weight is kept whole when any member matches
  smooth      (w8a8) a weight whose columns carry SmoothQuant factors
  experts     dsc.moe(x, ids, w, gate_up, down, e0) -> dsc.moe(..., gate_up.qweight, down.qweight, e0,
              gate_up.scale, down.scale): the experts' weights int8 with one scale per row
              (W8A16 in every --int8-mode, per channel whatever the group size; --int8-skip
              applies to the experts' module path)
Weight specs: `<W>.qweight`, `<W>.scale` (and `<W>.zero` when asymmetric) are W's spec with
  `quant=Quant(part, group_size, symmetric)`; emit quantizes each rank's shard after sharding
  (compiler/rank_files.py RankTensors), so scale groups are groups of the rank's local input
  features; a row-parallel shard of a weight that tp=1 quantizes per channel takes its whole
  rows' scales, so at any tp every int8 entry and scale is tp=1's. W itself is dropped when
  nothing else reads it (a tied embedding keeps it).
  A linear is "in the blocks" when its module path has a numbered component (layers.3, h.3).
Group size per layer: --int8-group-size G, which must divide the layer's local input
  features (after tensor-parallel sharding), or the compile stops naming the layer. DeepSpeed's
  q_groups Q (--int8-q-groups, or a DeepSpeed config's `quant.weight.q_groups`) splits each (local) [out, in] matrix,
  flattened, into Q chunks with one scale each. When Q <= out, a chunk spans out/Q whole rows
  and dsc's one scale per row is strictly finer, so per-channel is used; when Q > out, a chunk
  is out*in/Q consecutive elements of one row, and group_size is the largest divisor of the
  row's (local) input features not above that: never coarser than DeepSpeed's.
SmoothQuant (w8a8): the program as it stands (sharded, fused, unquantized) runs on the
  calibration prompts (--calibrate FILE, else 512 tokens of the built-in sample text in the
  checkpoint's tokenizer; a checkpoint without one is not smoothed) (compiler/simulate.py) to
  record max|x| per input channel of every quantized linear; s = max|x|^0.5 / max|W[:, k]|^0.5
  (clamped to [1e-5, 1e5]). The
  weight spec gets col_scale = s (columns scaled before quantization) and the op gets
  inv_smooth = 1/s, which the activation-quantization kernel applies as it reads x. Every
  linear gets its own s (no norm weight is shared between q, k, v) and o_proj / down_proj
  are smoothed too.
Requires: canonicalize (weights are [out, in] linears); runs after shard_tensor_parallel and the
  fusions, before plan_kernels. Guarantees: no aten.linear in the blocks reads a float weight
  (unless skipped, or kept by --auto-precision); every quantized get_attr has a spec with `quant`;
  node vals show local shapes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from pathlib import Path

import torch
import torch.fx as fx

from dsc.compiler.ir import Model, Quant, Shard, WeightSpec, weight_nodes
from dsc.compiler.serialize import _module_path
from dsc.compiler.weights import local_dtype, local_shape
from dsc.errors import UserError
from dsc.passes._util import arg_node, aten, attr_name, is_call, is_router, replace_with

SMOOTH_ALPHA = 0.5
_IN_BLOCK = re.compile(r"\.\d+(\.|$)")


def _layer(name: str) -> str:
    return name.removesuffix(".weight")


def _linears(graph: fx.Graph, weights: dict[str, WeightSpec]) -> list[fx.Node]:
    out = []
    for n in graph.nodes:
        if is_call(n, aten.linear.default) and not n.kwargs:
            w = n.args[1]
            if (
                isinstance(w, fx.Node)
                and w.op == "get_attr"
                and w.target in weights
                and len(weights[w.target].shape) == 2
                and weights[w.target].quant is None
            ):
                out.append(n)
    return out


def _shared(graph: fx.Graph) -> set[str]:
    """Weights something other than a linear's weight argument reads (the embedding of a tied
    lm_head): they stay in the compute dtype for that reader."""
    return {
        n.target
        for n in graph.nodes
        if n.op == "get_attr" and any(not (is_call(u, aten.linear.default) and u.args[1] is n) for u in n.users)
    }


def _keep_reason(model: Model, node: fx.Node, shared: set[str]) -> str | None:
    """Why this linear stays unquantized ("keep_head" / "skip"), or None."""
    opts = model.options
    name = attr_name(arg_node(node, 1))
    spec = model.weights[name]
    paths = {_layer(name), *(_layer(s) for s in spec.sources), _module_path(node) or ""}
    if any(fnmatch.fnmatchcase(p, pat) for p in paths if p for pat in opts.int8_skip):
        return "skip"
    if is_router(node):
        return "keep_router"
    in_block = _IN_BLOCK.search(_layer(name)) and name not in shared
    if not in_block and not opts.int8_lm_head:
        return "keep_head"
    return None


def calibration_prompts(path: str | Path, ckpt, max_seq: int) -> list[list[int]]:
    """One prompt per non-empty line: text (with the checkpoint's tokenizer.json) or, for a
    checkpoint without a tokenizer, token ids separated by spaces or commas. Prompts are cut
    to max_seq - 1 tokens."""
    path = Path(path)
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    except FileNotFoundError:
        raise UserError(f"{path}: calibration file not found") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise UserError(f"{path}: not a UTF-8 text file of prompts ({type(e).__name__})") from None
    numbered = [(i, ln) for i, ln in enumerate(lines, 1) if ln]
    if not numbered:
        raise UserError(f"{path}: no calibration prompts (one per line)")
    tok_file = ckpt.root / "tokenizer.json"
    tok = None
    if tok_file.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
    vocab = ckpt.config["vocab_size"]
    out = []
    for i, ln in numbered:
        if tok is not None:
            ids = tok.encode(ln).ids
        else:
            try:
                ids = [int(t) for t in ln.replace(",", " ").split()]
            except ValueError:
                raise UserError(
                    f"{path}:{i}: {ckpt.root} has no tokenizer.json; write calibration prompts as token ids"
                ) from None
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"{path}:{i}: token id {bad[0]} outside the vocabulary (0..{vocab - 1})")
        if ids:
            out.append(ids[: max_seq - 1])
    if not out:
        raise UserError(f"{path}: every calibration prompt is empty after tokenization")
    return out


def group_size_for(model: Model, name: str, tp: int | None = None) -> int | None:
    """The layer's group size (None: per output channel); UserError when it does not fit.
    `name`: the weight or its qweight part; `tp`: as if compiled at that tp (default the model's)."""
    opts = model.options
    tp = opts.tp if tp is None else tp
    out, inp = local_shape(model.weights[name], tp)
    where = f"{_layer(name)} ({'rank-local ' if tp > 1 else ''}weight [{out}, {inp}]"
    where += f", tp={tp})" if tp > 1 else ")"
    if opts.int8_group_size and opts.int8_q_groups:
        raise UserError("--int8-group-size and q_groups both set; give one")
    gs, given = opts.int8_group_size, f"--int8-group-size {opts.int8_group_size}"
    if opts.int8_q_groups:
        q = opts.int8_q_groups
        if q <= out:
            return None
        chunk = max(1, out * inp // q)  # DeepSpeed's elements per scale
        gs = max(d for d in range(1, chunk + 1) if inp % d == 0)
        given = f"q_groups={q} (group size {gs})"
    if gs is None:
        return None
    if inp % gs:
        why = "scale groups must not cross shard boundaries: " if tp > 1 else ""
        raise UserError(f"{given} does not divide the {inp} input features of {where}; {why}choose a divisor of {inp}")
    if opts.int8_mode == "w8a8" and gs % 32:
        raise UserError(f"{given}: w8a8 needs a multiple of 32 (the int8 MMA's K step), at {where}")
    return None if gs == inp else gs


def _new_attr(model: Model, graph: fx.Graph, after: fx.Node, name: str, spec: WeightSpec) -> fx.Node:
    """get_attr `name` (once per graph), its val a fake tensor of the rank-local part."""
    node = weight_nodes(graph).get(name)
    if node is None:
        with graph.inserting_after(after):
            node = graph.get_attr(name)
        with torch._guards.detect_fake_mode([after.meta.get("val")]) or model.fake_mode:
            node.meta["val"] = torch.empty(local_shape(spec, model.options.tp), dtype=local_dtype(spec))
    return node


def _parts(
    model: Model,
    name: str,
    gs: int | None,
    col_scale: torch.Tensor | None,
    symmetric: bool | None = None,
    scheme: str = "int8",
) -> dict[str, WeightSpec]:
    """Specs of W's quantized parts (and of its inv_smooth vector), registered in model.weights."""
    spec = dataclasses.replace(model.weights[name], col_scale=col_scale)
    sym = not model.options.int8_asymmetric if symmetric is None else symmetric
    names = {"qweight": f"{name}.qweight", "scale": f"{name}.scale"} | ({} if sym else {"zero": f"{name}.zero"})
    out = {}
    for part, pname in names.items():
        out[pname] = dataclasses.replace(spec, quant=Quant(part, gs, sym, scheme))
    if col_scale is not None:
        shard = spec.shard
        vec_shard = Shard(0, shard.blocks, shard.groups) if shard is not None and shard.dim == 1 else None
        out[f"{name}.inv_smooth"] = WeightSpec(
            sources=(), shape=(spec.shape[1],), dtype="float32", shard=vec_shard, const=(1.0 / col_scale).float()
        )
    model.weights.update(out)
    return out


def _rewrite(model: Model, graph: fx.Graph, node: fx.Node, gs: int | None, smoothed: bool) -> None:
    opts = model.options
    w = arg_node(node, 1)
    name = attr_name(w)
    x, bias = node.args[0], (node.args[2] if len(node.args) > 2 else None)
    k = local_shape(model.weights[name], opts.tp)[1]
    attr = lambda suffix: _new_attr(model, graph, w, f"{name}.{suffix}", model.weights[f"{name}.{suffix}"])  # noqa: E731
    qw, sc = attr("qweight"), attr("scale")
    zero = attr("zero") if opts.int8_asymmetric else None
    if opts.int8_mode == "w8a8":
        inv = attr("inv_smooth") if smoothed else None
        replace_with(node, torch.ops.dsc.linear_w8a8.default, (x, qw, sc, zero, bias, gs or k, inv))
    else:
        replace_with(node, torch.ops.dsc.linear_w8a16.default, (x, qw, sc, zero, bias, gs or k))
    model.counters[f"quantize_int8.{opts.int8_mode}"] += 1


def _rewrite_fp8(model: Model, graph: fx.Graph, node: fx.Node) -> None:
    w = arg_node(node, 1)
    name = attr_name(w)
    x, bias = node.args[0], (node.args[2] if len(node.args) > 2 else None)
    qw, sc = (_new_attr(model, graph, w, f"{name}.{p}", model.weights[f"{name}.{p}"]) for p in ("qweight", "scale"))
    replace_with(node, torch.ops.dsc.linear_fp8.default, (x, qw, sc, bias))
    model.counters["quantize_int8.fp8"] += 1


def _quantize_experts(model: Model) -> set[str]:
    """Every dsc.moe's float expert weights -> int8 rows with per-row scales; their names."""
    names: set[str] = set()
    for _, graph in model.graphs():
        for n in [n for n in graph.nodes if n.target is torch.ops.dsc.moe.default and len(n.args) < 7]:
            gate_up, down = n.args[3], n.args[4]
            paths = {_module_path(n) or "", gate_up.target.rsplit(".", 1)[0]}  # ...mlp.experts
            if any(fnmatch.fnmatchcase(p, pat) for p in paths if p for pat in model.options.int8_skip):
                model.counters["quantize_int8.skip"] += 1
                continue
            parts = []
            for w in (gate_up, down):
                if w.target not in names:
                    _parts(model, w.target, None, None, symmetric=True)
                    names.add(w.target)
                parts.append(
                    [
                        _new_attr(model, graph, w, f"{w.target}.{part}", model.weights[f"{w.target}.{part}"])
                        for part in ("qweight", "scale")
                    ]
                )
            (qgu, sgu), (qdn, sdn) = parts
            n.args = (*n.args[:3], qgu, qdn, n.args[5], sgu, sdn)
            model.counters["quantize_int8.experts"] += 1
    return names


def quantize_int8(model: Model) -> Model:
    opts = model.options
    if opts.fp8:
        return _quantize_fp8(model)
    if opts.int4:
        return _quantize_int4(model)
    if opts.auto_precision is not None:
        return _quantize_auto(model)
    if not opts.int8:
        return model
    experts = _quantize_experts(model)
    targets = _targets(model)
    groups = {name: group_size_for(model, name) for name in targets}  # all checks before any rewrite
    prompts = smoothing_prompts(model) if opts.int8_mode == "w8a8" else None
    smooth = smoothing_factors(model, targets, prompts) if prompts else {}
    for name, uses in targets.items():
        _parts(model, name, groups[name], smooth.get(name))
        if name in smooth:
            model.counters["quantize_int8.smooth"] += 1
        for graph, node in uses:
            _rewrite(model, graph, node, groups[name], name in smooth)
    _drop_float_weights(model, [*targets, *experts])
    model.notes["int8"] = {
        "mode": opts.int8_mode,
        "symmetric": not opts.int8_asymmetric,
        "group_size": opts.int8_group_size,
        "q_groups": opts.int8_q_groups,
        "lm_head": opts.int8_lm_head,
        "skip": list(opts.int8_skip),
        "smoothquant": bool(smooth),
        "weights": len(targets) + len(experts),
    }
    return model


def _targets(model: Model) -> dict[str, list[tuple[fx.Graph, fx.Node]]]:
    """{weight name: its (graph, linear) uses} of the linears to quantize (counting the kept ones)."""
    targets: dict[str, list[tuple[fx.Graph, fx.Node]]] = {}
    for _, graph in model.graphs():
        shared = _shared(graph)
        for node in _linears(graph, model.weights):
            reason = _keep_reason(model, node, shared)
            if reason:
                model.counters[f"quantize_int8.{reason}"] += 1
            else:
                targets.setdefault(attr_name(arg_node(node, 1)), []).append((graph, node))
    return targets


def _drop_float_weights(model: Model, names: list[str]) -> None:
    """Erase the get_attrs nothing reads, and the specs of the quantized weights no node reads."""
    for _, graph in model.graphs():
        for n in list(graph.nodes):
            if n.op == "get_attr" and not n.users:
                graph.erase_node(n)
    used = {n.target for _, g in model.graphs() for n in g.nodes if n.op == "get_attr"}
    for name in names:
        if name not in used:
            del model.weights[name]


def _quantize_fp8(model: Model) -> Model:
    targets = _targets(model)
    for name, uses in targets.items():
        _parts(model, name, None, None, symmetric=True, scheme="fp8")
        for graph, node in uses:
            _rewrite_fp8(model, graph, node)
    _drop_float_weights(model, list(targets))
    opts = model.options
    model.notes["fp8"] = {
        "format": "e4m3",
        "weights": "per output channel",
        "activations": "per token, dynamic",
        "lm_head": opts.int8_lm_head,
        "skip": list(opts.int8_skip),
        "linears": len(targets),
    }
    return model


def _quantize_int4(model: Model) -> Model:
    from dsc.passes.auto_precision import layer_group

    opts = model.options
    targets = _targets(model)
    groups: dict[str, int] = {}
    for name in targets:  # every layer checked before any rewrite
        out, inp = local_shape(model.weights[name], opts.tp)
        gs = layer_group(model, name)
        if gs is None:
            at = f", tp={opts.tp}" if opts.tp > 1 else ""
            given = (
                f"--int4-group-size {opts.int4_group_size}"
                if opts.int4_group_size
                else "no int4 group size (128, 64, 32)"
            )
            other = f", or choose a multiple of 32 dividing {inp}" if opts.int4_group_size else ""
            raise UserError(
                f"{given} does not divide the {inp} input features of {_layer(name)} "
                f"({'rank-local ' if opts.tp > 1 else ''}weight [{out}, {inp}]{at}); keep it in "
                f"16-bit with --int8-skip '{_layer(name)}'{other}"
            )
        groups[name] = gs
    for name, uses in targets.items():
        _rewrite_int4(model, name, uses, groups[name])
    _drop_float_weights(model, list(targets))
    model.notes["int4"] = {
        "group_sizes": sorted(set(groups.values())),
        "lm_head": opts.int8_lm_head,
        "skip": list(opts.int8_skip),
        "linears": len(targets),
    }
    return model


def _rewrite_int4(model: Model, name: str, uses: list[tuple[fx.Graph, fx.Node]], gs: int) -> None:
    spec = model.weights[name]
    model.weights.update(
        {
            f"{name}.{p}": dataclasses.replace(spec, quant=Quant(p, gs, False, "int4"))
            for p in ("qweight", "scale", "min")
        }
    )
    for graph, node in uses:
        w = arg_node(node, 1)
        x, bias = node.args[0], (node.args[2] if len(node.args) > 2 else None)
        qw, sc, mn = (
            _new_attr(model, graph, w, f"{name}.{p}", model.weights[f"{name}.{p}"]) for p in ("qweight", "scale", "min")
        )
        replace_with(node, torch.ops.dsc.linear_w4a16.default, (x, qw, sc, mn, bias, gs))
        model.counters["quantize_int8.int4"] += 1


def _quantize_auto(model: Model) -> Model:
    """--auto-precision: passes/auto_precision.py chooses; int4 and int8 (W8A16, per channel) rewrites."""
    from dsc.passes.auto_precision import choose, layer_group

    opts = model.options
    targets = _targets(model)
    assign, notes = choose(model, list(targets), opts.auto_precision)
    for name, uses in targets.items():
        if assign[name] == "int4":
            gs = layer_group(model, name)
            assert gs is not None  # choose offers int4 only where a group size fits
            _rewrite_int4(model, name, uses, gs)
        elif assign[name] == "int8":
            _parts(model, name, None, None, symmetric=True)
            for graph, node in uses:
                _rewrite(model, graph, node, None, False)
        else:
            model.counters["quantize_int8.auto_16bit"] += len(uses)
    _drop_float_weights(model, [n for n in targets if assign[n]])
    model.notes["auto_precision"] = {**notes, "layers": {_layer(n): assign[n] or "16-bit" for n in sorted(targets)}}
    return model


# -- SmoothQuant -----------------------------------------------------------------------------


CALIBRATION_BATCH = 8  # prompts per prefill run (each run reads every weight once)
SAMPLE_PROMPTS, SAMPLE_TOKENS = 8, 64  # the built-in sample's calibration chunks: one run of 512 tokens


def activation_maxima(
    model: Model, targets: dict[str, list[tuple[fx.Graph, fx.Node]]], prompts: list[list[int]]
) -> dict[str, torch.Tensor]:
    """max|x| [in] per weight over the prompts' tokens (padding excluded), from the unquantized
    prefill program (every rank; a row-parallel shard's columns go to their global indices)."""
    from dsc.compiler.simulate import Simulator, weight_bytes
    from dsc.compiler.weights import SourceReader, float_tensor, local_columns

    world = model.options.tp
    prefill = model.programs["prefill"]
    watch = {node: name for name, uses in targets.items() for g, node in uses if g is prefill}
    index = {
        name: [
            local_columns(model.weights[name], torch.arange(model.weights[name].shape[1]), r, world)
            for r in range(world)
        ]
        for name in targets
    }
    amax = {name: torch.zeros(model.weights[name].shape[1]) for name in targets}
    valid = None  # [B * L] bool: real tokens of the current batch, row-major over [B, L]

    def observe(node, rank, args):
        name = watch.get(node)
        if name is not None:
            x = args[0].float()
            x = (
                x.reshape(-1, x.shape[-1])[valid]
                if x.numel() // x.shape[-1] == valid.numel()
                else x.reshape(-1, x.shape[-1])
            )
            idx = index[name][rank]
            amax[name][idx] = torch.maximum(amax[name][idx], x.abs().amax(0))

    with SourceReader(model.checkpoint) as reader:
        sim = Simulator(
            model,
            lambda n, r: float_tensor(model.weights[n], r, world, reader),
            world,
            batch=min(CALIBRATION_BATCH, len(prompts)),
            seq=max(2, max(map(len, prompts))),
            weight_bytes=weight_bytes(model),
        )
        for i in range(0, len(prompts), CALIBRATION_BATCH):
            batch = prompts[i : i + CALIBRATION_BATCH]
            L = max(2, max(map(len, batch)))
            valid = (torch.arange(L)[None, :] < torch.tensor([len(p) for p in batch])[:, None]).reshape(-1)
            sim.prefill(batch, observe=observe)
    return amax


def smoothing_prompts(model: Model) -> list[list[int]] | None:
    """SmoothQuant's calibration prompts: --calibrate's, else SAMPLE_PROMPTS chunks of
    SAMPLE_TOKENS tokens of the built-in sample text (compiler/sample_text.py) in the
    checkpoint's tokenizer; None (no smoothing) for a checkpoint without a tokenizer."""
    from dsc.compiler.sample_text import sample_prompts

    opts = model.options
    if opts.calibrate:
        return calibration_prompts(opts.calibrate, model.checkpoint, opts.max_seq)
    return sample_prompts(
        model.checkpoint.root, SAMPLE_PROMPTS, min(SAMPLE_TOKENS, opts.max_seq - 1), model.config["vocab_size"]
    )


def smoothing_factors(
    model: Model, targets: dict[str, list[tuple[fx.Graph, fx.Node]]], prompts: list[list[int]]
) -> dict[str, torch.Tensor]:
    """s [in] per weight: max|x|^a / max|W[:, k]|^(1-a), a = SMOOTH_ALPHA."""
    from dsc.compiler.weights import SourceReader, float_tensor

    xmax = activation_maxima(model, targets, prompts)
    out = {}
    with SourceReader(model.checkpoint) as reader:
        for name in targets:
            spec = dataclasses.replace(model.weights[name], shard=None, dtype="float32")
            wmax = float_tensor(spec, 0, 1, reader).abs().amax(0)  # [in]
            s = xmax[name].pow(SMOOTH_ALPHA) / wmax.pow(1 - SMOOTH_ALPHA)
            ok = (xmax[name] > 0) & (wmax > 0)
            out[name] = torch.where(ok, s, torch.ones_like(s)).clamp(1e-5, 1e5)
    return out
