"""`dsc compile --target sm_90`: the plan's Triton kernels compiled ahead of time, without a GPU.

1. **Record.** Every program of the plan runs on meta tensors at the shapes the runtime's runners
   give it with the serving defaults (runtime/ragged.py's decode and mixed-step buckets for the
   ragged program, the static decode buckets, the encoder's (batch, length) buckets), with each
   dsc op running its CUDA implementation (the wrapper that picks configs and launches) and each
   kernel launch recording its spec (kernels/binaries.py) instead of running. The configs come
   from kernels/tuning.json for the target, as on that GPU.
2. **Build.** Each distinct spec is compiled for each target by `triton.compile` (Triton's
   bundled `ptxas`; no GPU, no driver).
3. **Write.** `kernels/<kernel>-<digest>.<target>.cubin` per binary and `kernels/binaries.json`
   (format, targets, and per binary its spec, entry, sizes and PTX parameter types), listed and
   hashed in the manifest like every other file.

Launches outside those shapes (eager steps over the largest bucket, the static prefill
program) have no binary; the runtime compiles them with Triton, saying so once per kernel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from dsc.errors import UserError
from dsc.kernels import binaries as B
from dsc.kernels.registry import CUDA_IMPLS
from dsc.runtime.binaries import INDEX, INDEX_FORMAT, INDEX_VERSION

SERVING_MAX_NUM_SEQS = 256  # `dsc serve`'s and `dsc.LLM`'s default --max-num-seqs
META = torch.device("meta")


class _CudaImpls(TorchDispatchMode):
    """dsc ops on meta tensors run their CUDA implementation (their kernels then record), the
    dsc ops an implementation calls too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = CUDA_IMPLS.get(func.name())
        if impl is not None:
            with _CudaImpls():
                return impl(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _program(plan: dict, name: str, pool: dict) -> fx.GraphModule:
    from dsc.runtime.plan import build_graph

    graph, targets = build_graph(plan["programs"][name]["nodes"], META, where=f"plan.json: program {name!r}")
    weights = {}
    for n in plan["programs"][name]["nodes"]:
        if n["kind"] == "weight" and n["target"] not in pool:
            weights[n["target"]] = torch.empty(n["shape"], dtype=getattr(torch, n["dtype"]), device=META)
    kv = plan.get("kv_cache")
    for t in targets:
        if t in pool:
            weights[t] = pool[t]
        elif t.startswith("kv_cache.") and kv:
            weights[t] = torch.empty(kv["shape"], dtype=getattr(torch, kv["dtype"]), device=META)
    return fx.GraphModule(weights, graph)


def _runs(plan: dict) -> list[tuple[str, object]]:
    """(program, step) for every shape the runtime's runners launch a program at by default."""
    from dsc.runtime.decode import DecodeStep
    from dsc.runtime.prefill import EncodeRunner, EncodeStep, length_buckets
    from dsc.runtime.ragged import MAX_TOKENS, MIN_TOKENS, GraphStep, decode_buckets
    from dsc.runtime.scheduler import DEFAULT_BUDGET

    lim, progs = plan["limits"], plan["programs"]
    runs: list[tuple[str, object]] = []
    if "encode" in progs:
        pad = int(plan["model"].get("pad_token_id") or 0)
        batch = 1
        while batch <= max(1, lim["max_batch"]):
            for length in length_buckets(lim["max_seq"]):
                if batch * length <= EncodeRunner.max_graph_tokens:
                    runs.append(("encode", EncodeStep(None, batch, length, META, pad)))
            batch *= 2
    if "ragged" in progs and plan.get("kv_pool"):
        max_blocks = -(-lim["max_seq"] // plan["kv_pool"]["block_size"])
        buckets = decode_buckets(SERVING_MAX_NUM_SEQS)
        for b in buckets:
            runs.append(("ragged", GraphStep(None, b, b, max_blocks, META)))
        t = MIN_TOKENS
        while t <= min(DEFAULT_BUDGET, MAX_TOKENS):
            for n in buckets:
                runs.append(("ragged", GraphStep(None, t, n, max_blocks, META)))
            t *= 2
    if "decode" in progs:
        for b in lim.get("decode_buckets") or [lim["max_batch"]]:
            runs.append(("decode", DecodeStep(None, b, META)))
    return runs


def record(plan: dict, arch: str) -> tuple[list[B.Spec], dict[str, str]]:
    """The specs of every kernel launch the plan's programs make at the runtime's default shapes
    on `arch`, in first-launch order, and the kernels whose launches have no spec (name -> why)."""
    from dsc.runtime.ragged import allocate_kv_pool

    pool = allocate_kv_pool(plan, META, None, where=Path("plan.json"), serving=False) if plan.get("kv_pool") else {}
    programs = {name: _program(plan, name, pool) for name in plan["programs"]}
    with B.recording(arch) as rec, _CudaImpls(), torch.inference_mode():
        for name, step in _runs(plan):
            step.program = programs[name]
            step._forward()
    return list(rec.specs.values()), dict(rec.skipped)


def build(spec: B.Spec, target: str) -> dict:
    """Compile one spec for one target: {"cubin": bytes, "entry", "num_warps", "shared", "params"}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from dsc.kernels.launch import _KERNELS

    kernel = next(k for k in _KERNELS.values() if k.name == spec.kernel)
    fn = kernel.jitted
    constants = dict(spec.constants)
    signature = {name: ty for name, ty, _ in spec.args}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, ty, aligned in spec.args if aligned}
    source = (GluonASTSource if spec.dialect == "gluon" else ASTSource)(fn, signature, constants, attrs)
    options = {"enable_fp_fusion": True, **dict(spec.options)}  # Triton's default, stated (3.9 warns when unset)
    compiled = triton.compile(source, target=GPUTarget("cuda", int(target[3:]), 32), options=options)
    md = compiled.metadata
    for name in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, name, 0):
            raise B.Unsupported(f"it needs {name} {getattr(md, name)}")
    if getattr(md, "num_ctas", 1) != 1 or tuple(getattr(md, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) not in (
        (1, 1, 1),
        (0, 0, 0),
    ):
        raise B.Unsupported("it launches thread-block clusters")
    params = B.ptx_params(compiled.asm["ptx"], md.name)
    runtime_args = sum(ty != "constexpr" for _, ty, _ in spec.args)
    if len(params) < runtime_args or any(t not in ("u64", "b64") for t in params[runtime_args:]):
        raise B.Unsupported(f"its PTX entry takes {len(params)} parameters for {runtime_args} arguments")
    return {
        "cubin": compiled.asm["cubin"],
        "entry": md.name,
        "num_warps": md.num_warps,
        "shared": md.shared,
        "params": params,
    }


_SAFE = re.compile(r"[^A-Za-z0-9_]+")


def write(folder: Path, plan: dict, targets: list[str]) -> dict:
    """Record, build and write the binaries of `plan` for `targets` into folder/kernels/.
    Returns the manifest's summary: {"targets", "binaries", "bytes", "skipped"}."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError(
            "--target: compiling kernels needs triton (pip install 'dsc[gpu]'); it runs on a machine without a GPU"
        ) from None
    entries, skipped, total = [], {}, 0
    out = folder / "kernels"
    out.mkdir(exist_ok=True)
    jobs = []
    for target in targets:
        specs, why = record(plan, target)
        skipped.update(why)
        jobs += [(spec, target) for spec in specs]

    def build_one(job):
        try:
            return build(*job)
        except B.Unsupported as e:
            return e

    # in this thread, one at a time: Triton's front end calls ast.parse, which CPython 3.11 cannot
    # run on two threads at once
    built = [build_one(job) for job in jobs]
    for (spec, target), b in zip(jobs, built):
        if isinstance(b, B.Unsupported):
            skipped.setdefault(spec.kernel, str(b))
            continue
        digest = spec.digest()
        name = f"{_SAFE.sub('_', spec.kernel.split(':')[-1])}-{digest[:16]}.{target}.cubin"
        (out / name).write_bytes(b["cubin"])
        total += len(b["cubin"])
        entries.append(
            {
                "target": target,
                "file": f"kernels/{name}",
                "entry": b["entry"],
                "num_warps": b["num_warps"],
                "shared": b["shared"],
                "params": b["params"],
                "spec": spec.to_json(),
            }
        )
    index = {"format": INDEX_FORMAT, "format_version": INDEX_VERSION, "targets": list(targets), "binaries": entries}
    (folder / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return {
        "targets": list(targets),
        "binaries": len(entries),
        "bytes": total,
        "skipped": dict(sorted(skipped.items())),
    }


def summary(info: dict) -> str:
    """The compile's line(s) about the binaries it wrote."""
    lines = [
        f"kernel binaries: {info['binaries']} for {', '.join(info['targets'])} "
        f"({info['bytes'] / 2**20:.1f} MiB); the runtime uses them with --trust-kernels or a verified signature"
    ]
    lines += [
        f"  kernel {name.split(':')[-1]}: no binary ({why}); Triton compiles it at run time"
        for name, why in info["skipped"].items()
    ]
    return "\n".join(lines)
