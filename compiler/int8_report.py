"""The int8 accuracy report, measured at compile time before the artifact is published.

    weight SQNR per layer   10 log10(|W|^2 / |W - dequant(Q)|^2) over the whole weight, in the
                            original weight space (SmoothQuant's column scales divided out)
    logits                  SQNR (dB), mean KL(P_fp || P_int8) and top-1 agreement between the
                            quantized program and its unquantized twin at the last POSITIONS
                            positions of every prompt, teacher-forced on the prompt's own tokens
    memory                  bytes of the quantized linears: int8 values, scales/zero points,
                            and the same weights at 16 bits
The logits come from the prefill program the artifact will hold (sharded and fused), run for
every rank in the compiler's process (compiler/simulate.py), once per program: all prompts in
one batch, the logits taken at every evaluated position of that run. Both programs compute in
float32 whatever the artifact's dtype (each weight upcast a block at a time as it is read, the
KV cache in fp32): the difference between them is the quantization error of the weights (and,
in w8a8, of the activations), not 16-bit rounding. The two programs run at the same time, on
two threads. Each weight is produced when a node first reads it (memory stays bounded); the
twin is the quantized program with each dsc int8 linear turned back into aten.linear on its
float weight. Inputs: the calibration prompts when given (the first REPORT_PROMPTS, cut to
REPORT_TOKENS), else the first REPORT_PROMPTS chunks of REPORT_TOKENS tokens of the built-in
sample text (compiler/sample_text.py) in the checkpoint's tokenizer; only a checkpoint without
a tokenizer gets three random-token prompts (lengths 11, 7, 3), and the report says so: on
random tokens the logits are flat and their SQNR is far below what the same model reaches on text.

`compile` runs it once the rank files are written (in the temporary folder): the quantized
program reads the written weights, the twin reads the checkpoint once (each tensor whole, then
every rank's slice of it), and the weight SQNR comes from the emit, measured as it quantized:
the report costs one more read of the checkpoint and of the rank files. It prints the summary,
writes the report into manifest.json ("int8_report"), and with --int8-min-sqnr fails when the
logits SQNR is lower (the artifact is then not published: nothing at the destination).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.fx as fx

from dsc.compiler.ir import Model
from dsc.compiler.rank_files import RankTensors, sqnr_db, weight_sqnr_db
from dsc.compiler.sample_text import POSITIONS, REPORT_PROMPTS, REPORT_TOKENS, report_inputs
from dsc.errors import UserError
from dsc.kernels import registry
from dsc.passes import quantize_int8

READ_KEEP = 256 << 20  # bytes of whole source tensors kept while the ranks take their slices


def unquantized(model: Model) -> Model:
    """The model with every dsc int8 linear turned back into aten.linear on its float weight
    (the spec without `quant` and SmoothQuant's `col_scale`)."""
    programs, weights = {}, {}
    for pname, graph in model.graphs():
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        g.output(g.graph_copy(graph, env))
        attrs: dict[str, fx.Node] = {}

        def float_weight(qw: fx.Node, dtype: torch.dtype) -> fx.Node:
            from dsc.compiler.weights import local_shape

            base = qw.target.removesuffix(".qweight")
            weights[base] = dataclasses.replace(model.weights[qw.target], quant=None, col_scale=None)
            if base not in attrs:
                with g.inserting_before(qw):
                    attrs[base] = g.get_attr(base)
                with torch._guards.detect_fake_mode([qw.meta["val"]]) or model.fake_mode:
                    shape = local_shape(weights[base], model.options.tp)  # not the qweight's: int4 packs two per byte
                    attrs[base].meta["val"] = torch.empty(shape, dtype=dtype)
            return attrs[base]

        for _old, new in env.items():
            if new.op == "call_function" and new.target is torch.ops.dsc.moe.default and len(new.args) > 6:
                dtype = new.meta["val"].dtype  # int8 experts (quantize_int8's experts rule)
                new.args = (
                    *new.args[:3],
                    float_weight(new.args[3], dtype),
                    float_weight(new.args[4], dtype),
                    new.args[5],
                )
                continue
            if new.op != "call_function" or new.target not in _int8_targets():
                continue
            x, qw = new.args[0], new.args[1]
            bias = new.args[registry.traits(registry.op_name(new.target)).bias_arg]
            base = qw.target.removesuffix(".qweight")
            float_weight(qw, new.meta["val"].dtype)
            with g.inserting_before(new):
                lin = g.call_function(torch.ops.aten.linear.default, (x, attrs[base], bias))
            lin.meta.update(new.meta)
            new.replace_all_uses_with(lin)
            g.erase_node(new)
        g.eliminate_dead_code()
        for n in list(g.nodes):
            if n.op == "get_attr" and not n.users:
                g.erase_node(n)
        programs[pname] = g
    used = {n.target for g in programs.values() for n in g.nodes if n.op == "get_attr"}
    weights.update({k: v for k, v in model.weights.items() if k in used and v.quant is None})
    return dataclasses.replace(model, programs=programs, weights={k: weights[k] for k in sorted(used) if k in weights})


def _int8_targets():
    return {registry.resolve_torch_op(op) for op in registry.ops_with("quantized")}


METRIC_ROWS = 32  # positions whose float64 temporaries ([rows, V] each) exist at once


def logits_metrics(ref: torch.Tensor, q: torch.Tensor) -> dict:
    # ref, q: [positions, V]; summed in float64 over chunks of METRIC_ROWS positions
    signal = noise = kl = agree = 0.0
    for i in range(0, ref.shape[0], METRIC_ROWS):
        r, x = ref[i : i + METRIC_ROWS].double(), q[i : i + METRIC_ROWS].double()
        signal += float(r.pow(2).sum())
        noise += float((r - x).pow(2).sum())
        lp, lq = r.log_softmax(-1), x.log_softmax(-1)
        kl += float((lp.exp() * (lp - lq)).sum())
        agree += float((r.argmax(-1) == x.argmax(-1)).sum())
    n = int(ref.shape[0])
    return {
        "sqnr_db": round(sqnr_db(signal, noise), 3),
        "kl_div": round(kl / n, 6),
        "top1_agreement": round(agree / n, 4),
        "positions": n,
    }


def _run(model: Model, produce, prompts: list[list[int]], positions: int, lock: threading.Lock) -> torch.Tensor:
    from dsc.compiler.simulate import Simulator, weight_bytes

    sim = Simulator(
        model,
        produce,
        model.options.tp,
        batch=len(prompts),
        seq=max(2, max(map(len, prompts))),
        weight_bytes=weight_bytes(model),
        dtype=torch.float32,
        lock=lock,
    )
    if "encode" in model.programs:  # an encoder: every real token's last hidden state
        return sim.encoder_states(prompts, model.config.get("pad_token_id") or 0)
    return sim.logits_at(prompts, positions)


def hidden_metrics(ref: torch.Tensor, q: torch.Tensor) -> dict:
    """An encoder's output: SQNR over all tokens' last hidden states [n, E], and the lowest
    cosine similarity of one token's state with its unquantized twin's."""
    r, x = ref.double(), q.double()
    cos = torch.nn.functional.cosine_similarity(r, x, dim=-1)
    return {
        "sqnr_db": round(sqnr_db(float(r.pow(2).sum()), float((r - x).pow(2).sum())), 3),
        "min_cosine": round(float(cos.min()), 6),
        "positions": int(r.shape[0]),
    }


def _memory(model: Model) -> dict:
    from dsc.compiler.weights import local_dtype, local_shape

    world = model.options.tp
    out = {"int8_bytes": 0, "scale_bytes": 0, "bytes_16bit": 0}
    for spec in model.weights.values():
        if not spec.quant:
            continue
        n = math.prod(local_shape(spec, world)) * world
        if spec.quant.part == "qweight":
            out["int8_bytes"] += n
            out["bytes_16bit"] += (4 if spec.quant.scheme == "int4" else 2) * n
        else:
            out["scale_bytes"] += n * local_dtype(spec).itemsize
    return out


def report_prompts(model: Model) -> tuple[list[list[int]], str]:
    """The report's inputs and where they come from (module docstring)."""
    opts = model.options
    if opts.calibrate:
        length = min(REPORT_TOKENS, opts.max_seq - 1)
        prompts = quantize_int8.calibration_prompts(opts.calibrate, model.checkpoint, opts.max_seq)
        return [p[:length] for p in prompts][:REPORT_PROMPTS], "calibration"
    return report_inputs(model.checkpoint.root, model.config["vocab_size"], opts.max_seq)


def int8_report(
    model: Model,
    prompts: list[list[int]] | None = None,
    positions: int = POSITIONS,
    written: Path | None = None,
    weight_sqnr: dict[str, float] | None = None,
) -> dict:
    """Measure the quantized model against its unquantized twin (module docstring).

    `written`: a folder whose rank{i}.safetensors hold the model's weights (the artifact being
    emitted): the quantized program reads them instead of quantizing again, and
    `weight_sqnr` is the per-layer weight SQNR the emit measured as it quantized them."""
    from dsc.compiler.weights import SourceReader, float_tensor, torch_threads

    opts, world = model.options, model.options.tp
    prompts, source = report_prompts(model) if prompts is None else (prompts, "given")
    twin = unquantized(model)
    errors: dict[str, tuple[float, float]] = {}
    lock = threading.Lock()  # one program at a time holds a whole table (simulate.py)

    def run_twin() -> torch.Tensor:
        # whole tensors kept across the ranks: each rank's slice of a weight comes from one read
        with SourceReader(model.checkpoint, keep_bytes=READ_KEEP) as reader:
            return _run(twin, lambda n, r: float_tensor(twin.weights[n], r, world, reader), prompts, positions, lock)

    def run_quantized() -> torch.Tensor:
        if written is not None:
            with RankFiles(written, world) as files:
                return _run(model, files.tensor, prompts, positions, lock)
        with SourceReader(model.checkpoint, keep_bytes=READ_KEEP) as reader:
            return _run(model, RankTensors(model, reader, errors), prompts, positions, lock)

    # the two programs on two threads, torch ops on one thread each (weights/torch_threads)
    with torch_threads(1), ThreadPoolExecutor(2, thread_name_prefix="dsc-int8-report") as pool:
        ref_run, q_run = pool.submit(run_twin), pool.submit(run_quantized)
        ref, q = ref_run.result(), q_run.result()
    layers = (weight_sqnr or {}) if written is not None else weight_sqnr_db(errors)
    worst = sorted(layers, key=layers.get)[:5]
    vals = sorted(layers.values())
    return {
        "mode": "fp8"
        if opts.fp8
        else "int4"
        if opts.int4
        else "auto"
        if opts.auto_precision is not None
        else opts.int8_mode,
        "symmetric": not opts.int8_asymmetric and not opts.int4 and opts.auto_precision is None,
        "group_size": (opts.int4_group_size or "per layer") if opts.int4 else opts.int8_group_size,
        "q_groups": opts.int8_q_groups,
        "smoothquant": any(s.col_scale is not None for s in model.weights.values()),
        "inputs": {"source": source, "prompts": len(prompts), "positions_per_prompt": positions},
        **(
            {"hidden_states": hidden_metrics(ref, q)}
            if "encode" in model.programs
            else {"logits": logits_metrics(ref, q)}
        ),
        "weight_sqnr_db": {
            "min": vals[0] if vals else None,
            "median": vals[len(vals) // 2] if vals else None,
            "worst": [[k, layers[k]] for k in worst],
        },  # a list: JSON keys get sorted
        "layers": layers,
        "memory": _memory(model),
        **({"auto_precision": model.notes["auto_precision"]} if "auto_precision" in model.notes else {}),
    }


class RankFiles:
    """Tensors of rank{i}.safetensors in a folder, read with plain file reads (no mmap: the
    pages of a mapped file count in the RSS while it is open)."""

    def __init__(self, folder: Path, world: int):
        self.folder, self.world = Path(folder), world
        self._stack = contextlib.ExitStack()
        self._files: list[tuple] = []

    def __enter__(self) -> RankFiles:
        from dsc.runtime.artifact import read_safetensors_header

        for r in range(self.world):
            path = self.folder / f"rank{r}.safetensors"
            f = self._stack.enter_context(open(path, "rb"))
            (n,) = struct.unpack("<Q", f.read(8))
            self._files.append((f, 8 + n, read_safetensors_header(path)))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def tensor(self, name: str, rank: int) -> torch.Tensor:
        from dsc.compiler.weights import _ST_TO_TORCH, FileSlice

        f, start, header = self._files[rank]
        info = header[name]
        return FileSlice(f, start + info["data_offsets"][0], _ST_TO_TORCH[info["dtype"]], tuple(info["shape"]))[:]


def summary(report: dict) -> str:
    """A few lines for the terminal."""
    ws, mem = report["weight_sqnr_db"], report["memory"]
    name = report["mode"] if report["mode"] in ("fp8", "int4") else "mixed" if report["mode"] == "auto" else "int8"
    scheme = f"{report['mode']}, " + (
        f"group {report['group_size']}"
        if report["group_size"]
        else f"q_groups {report['q_groups']}"
        if report["q_groups"]
        else "per-channel"
    )
    scheme += ", symmetric" if report["symmetric"] else ", asymmetric"
    scheme += ", SmoothQuant" if report["smoothquant"] else ""
    if name == "fp8":
        scheme = "e4m3, per-channel weights, per-token activations"
    elif name == "int4":
        scheme = f"w4a16, group {report['group_size']}, scale and min per group"
    elif name == "mixed":
        from dsc.passes.auto_precision import summary_line

        scheme = summary_line(report["auto_precision"])
    inp = report["inputs"]
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    inputs = {
        "random tokens": "random-token prompts: the checkpoint has no tokenizer",
        "sample text": "prompts of the built-in sample text",
    }.get(inp["source"], f"{inp['source']} prompts")
    if "logits" in report:
        lg = report["logits"]
        quality = (
            f"  logits: SQNR {lg['sqnr_db']:.1f} dB, KL {lg['kl_div']:.2e}, top-1 agreement {lg['top1_agreement']:.1%}"
        )
    else:
        lg = report["hidden_states"]
        quality = f"  hidden states: SQNR {lg['sqnr_db']:.1f} dB, lowest cosine {lg['min_cosine']:.5f}"
    lines = [f"{name} report ({scheme}; {lg['positions']} positions of {inp['prompts']} {inputs}):", quality]
    if ws["min"] is not None:
        worst = ", ".join(f"{k} {v:.1f}" for k, v in ws["worst"][:3])
        lines.append(
            f"  weight SQNR over {len(report['layers'])} weights: median {ws['median']:.1f} dB, worst {worst} dB"
        )
    lines.append(
        f"  quantized linears: {mib(mem['int8_bytes'])} {name} + {mib(mem['scale_bytes'])} scales "
        f"(at 16 bits: {mib(mem['bytes_16bit'])})"
    )
    return "\n".join(lines)


def check_min_sqnr(report: dict, min_sqnr: float | None) -> None:
    """UserError when the logits SQNR is below --int8-min-sqnr, naming the worst layers."""
    what = "logits" if "logits" in report else "hidden_states"
    if min_sqnr is None or report[what]["sqnr_db"] >= min_sqnr:
        return
    worst = ", ".join(f"{k} ({v:.1f} dB)" for k, v in report["weight_sqnr_db"]["worst"])
    raise UserError(
        f"--int8-min-sqnr {min_sqnr:g}: {what.replace('_', '-')} SQNR is {report[what]['sqnr_db']:.1f} dB; "
        f"worst layers by weight SQNR: {worst}. Keep them in 16-bit with --int8-skip, "
        "or use --int8-group-size / --int8-asymmetric"
    )
