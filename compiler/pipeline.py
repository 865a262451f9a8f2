"""The pass pipeline, declared as data: `PASSES`, one row per pass, in the order they run.

A row names the pass, the function (`fn(model) -> model`, its contract in its module's docstring,
passes/<name>.py), when it runs (a function of the compile options, and the words the docs show),
the programs it may change, the passes that must run before it, and the contracts
(compiler/contracts.py) it requires and guarantees, with why it stands where it does.
`run_passes` runs the rows that the options enable and returns each pass's rewrite counts; with
`check=True` (`dsc compile --check-passes`, and the tests) it checks every contract between passes
and that a pass left the programs it does not name unchanged. docs/passes.md is generated from the
table (scripts/gen_docs.py).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsc.compiler import contracts as C
from dsc.compiler.ir import Model
from dsc.compiler.serialize import model_to_text, program_nodes
from dsc.errors import PassError, UserError
from dsc.passes.bind_kv_cache import bind_kv_cache
from dsc.passes.canonicalize import canonicalize
from dsc.passes.decode_linears import decode_linears
from dsc.passes.fold_position_tables import fold_position_tables
from dsc.passes.fuse_activation import fuse_activation
from dsc.passes.fuse_add_norm import fuse_add_norm
from dsc.passes.fuse_projections import fuse_projections
from dsc.passes.fuse_rotary import fuse_rotary
from dsc.passes.fuse_rotary_attention import fuse_rotary_attention
from dsc.passes.plan_kernels import plan_kernels
from dsc.passes.quantize_int8 import quantize_int8
from dsc.passes.select_decode_token import select_decode_token
from dsc.passes.shard_tensor_parallel import shard_tensor_parallel

Pass = Callable[[Model], Model]
ALL_PROGRAMS = ("prefill", "decode", "ragged", "encode")


def _always(options) -> bool:
    return True


def _fusing(options) -> bool:
    return bool(options.fuse)


def _quantizing(options) -> bool:
    return bool(options.int8 or options.fp8 or options.int4 or options.auto_precision is not None)


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: Pass
    why: str  # why it stands where it does in the order
    enabled: Callable[[object], bool] = _always
    runs: str = "always"  # `enabled` in the docs' words
    programs: tuple[str, ...] = ALL_PROGRAMS  # the programs it may change
    after: tuple[str, ...] = ()  # passes that must run before it, where enabled
    requires: tuple[C.Contract, ...] = ()
    guarantees: tuple[C.Contract, ...] = ()


@dataclass
class PassResult:
    name: str
    rewrites: dict[str, int] = field(default_factory=dict)  # "rule" -> count, from model.counters
    seconds: float = 0.0


_FUSED = "unless `--no-fuse`"
_QUANT = "with `--int8`, `--fp8`, `--int4` or `--auto-precision`"

PASSES: tuple[PassSpec, ...] = (
    PassSpec(
        "canonicalize",
        canonicalize,
        "first, so every later pattern sees one spelling (linear, no casts or dropout)",
        guarantees=(C.LINEAR, C.CASTS),
    ),
    PassSpec(
        "bind_kv_cache",
        bind_kv_cache,
        "before anything that rewrites attention shapes, so sharding sees the cache",
        after=("canonicalize",),
        requires=(C.LINEAR,),
        guarantees=(C.ATTENTION,),
    ),
    PassSpec(
        "shard_tensor_parallel",
        shard_tensor_parallel,
        "before the fusions, so a fused q/k/v concatenation combines the per-projection shards "
        "(blocks per source) instead of splitting the fused matrix as one block; a no-op at tp 1",
        after=("canonicalize", "bind_kv_cache"),
        requires=(C.LINEAR, C.ATTENTION),
        guarantees=(C.LOCAL_SHAPES,),
    ),
    PassSpec(
        "fuse_projections",
        fuse_projections,
        "the first fusion, so swiglu reads the fused gate_up output",
        _fusing,
        _FUSED,
        after=("bind_kv_cache", "shard_tensor_parallel"),
        requires=(C.LINEAR, C.LOCAL_SHAPES),
        guarantees=(C.LOCAL_SHAPES,),
    ),
    PassSpec(
        "fuse_add_norm",
        fuse_add_norm,
        "a fusion: after sharding, so it fuses the rank's all-reduce with the norm after it",
        _fusing,
        _FUSED,
        after=("canonicalize", "shard_tensor_parallel"),
        requires=(C.CASTS,),
    ),
    PassSpec(
        "fuse_rotary",
        fuse_rotary,
        "a fusion: after bind_kv_cache, whose attention nodes name their q and k",
        _fusing,
        _FUSED,
        after=("bind_kv_cache",),
        requires=(C.ATTENTION,),
    ),
    PassSpec(
        "fuse_activation",
        fuse_activation,
        "the last fusion before quantization, after fuse_projections (swiglu reads its output)",
        _fusing,
        _FUSED,
        after=("canonicalize", "fuse_projections"),
    ),
    PassSpec(
        "quantize_int8",
        quantize_int8,
        "after sharding and the fusions, so it quantizes the rank's fused weights",
        _quantizing,
        _QUANT,
        after=("canonicalize", "shard_tensor_parallel", "fuse_projections", "fuse_activation"),
        requires=(C.LINEAR, C.LOCAL_SHAPES),
        guarantees=(C.QUANTIZED, C.LOCAL_SHAPES),
    ),
    PassSpec(
        "fold_position_tables",
        fold_position_tables,
        "after the fusions: fuse_rotary reads the cos / sin it replaces by lookups",
        after=("canonicalize", "fuse_rotary"),
    ),
    PassSpec(
        "fuse_rotary_attention",
        fuse_rotary_attention,
        "a fusion of the decode program, after sharding and fold_position_tables, so it fuses the "
        "rank's final rotary + attention pair with cos / sin already table lookups",
        _fusing,
        _FUSED,
        programs=("decode",),
        after=("fuse_rotary", "shard_tensor_parallel", "fold_position_tables"),
        requires=(C.ATTENTION,),
    ),
    PassSpec(
        "select_decode_token",
        select_decode_token,
        "before decode_linears, so lm_head's linear reads a view",
        programs=("decode",),
    ),
    PassSpec(
        "decode_linears",
        decode_linears,
        "after every pass that matches aten.linear: it renames the decode and ragged programs' linears",
        programs=("decode", "ragged"),
        after=("shard_tensor_parallel", "fuse_projections", "fuse_activation", "quantize_int8", "select_decode_token"),
        guarantees=(C.DECODE_LINEARS,),
    ),
    PassSpec(
        "plan_kernels",
        plan_kernels,
        "last, so it plans the ops every other pass left; it changes no graph",
        programs=(),
        after=("decode_linears",),
        guarantees=(C.PLANNED,),
    ),
)


def enabled_passes(options) -> list[PassSpec]:
    """The rows these options enable, in order."""
    return [spec for spec in PASSES if spec.enabled(options)]


def pipeline(options) -> list[tuple[str, Pass]]:
    """(name, fn) of the passes for these options, in order."""
    return [(spec.name, spec.fn) for spec in enabled_passes(options)]


def check_order(passes: tuple[PassSpec, ...] = PASSES) -> list[str]:
    """Where a row's `after` names a pass that is not before it in the table."""
    seen: set[str] = set()
    names = {spec.name for spec in passes}
    bad = []
    for spec in passes:
        bad += [f"{spec.name} must run after {a}, which is not before it" for a in spec.after if a not in seen]
        bad += [f"{spec.name}: no pass {a!r}" for a in spec.after if a not in names]
        seen.add(spec.name)
    return bad


def dump(model: Model, dump_dir: Path, index: int, name: str) -> None:
    """Write the model after a pass: DIR/NN_name/{graph.txt, plan.json}."""
    d = Path(dump_dir) / f"{index:02d}_{name}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "graph.txt").write_text(model_to_text(model))
    plan = {
        "programs": {p: {"nodes": program_nodes(g, model.sym_names.get(p, {}))} for p, g in model.graphs()},
        "weights": {k: v.describe() for k, v in sorted(model.weights.items())},
        "kv_cache": model.kv_cache,
        "pass": name,
        "counters": {k: v for k, v in sorted(model.counters.items())},
    }
    (d / "plan.json").write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")


def _check(spec: PassSpec, model: Model, contracts: tuple[C.Contract, ...], when: str) -> None:
    for contract in contracts:
        found = contract.violations(model)
        if found:
            raise PassError(
                f"pass '{spec.name}': {when} contract '{contract.name}' ({contract.statement}) does not hold: "
                + "; ".join(found)
            )


def run_pass(spec: PassSpec, model: Model, check: bool = False) -> tuple[Model, PassResult]:
    """One pass: the model it returns and its rewrite counts. With `check`, its required contracts
    before it, its guaranteed ones after it, and the programs it does not name unchanged."""
    if check:
        _check(spec, model, spec.requires, "required")
        untouched = {p: str(g) for p, g in model.graphs() if p not in spec.programs}
    before = Counter(model.counters)
    start = time.perf_counter()
    model = spec.fn(model)
    for _, g in model.graphs():
        g.lint()
    seconds = time.perf_counter() - start
    prefix = f"{spec.name}."
    rewrites = {
        k.removeprefix(prefix): v - before.get(k, 0)
        for k, v in sorted(model.counters.items())
        if k.startswith(prefix) and v != before.get(k, 0)
    }
    if check:
        _check(spec, model, spec.guarantees, "guaranteed")
        changed = [p for p, g in model.graphs() if p in untouched and str(g) != untouched[p]]
        if changed:
            raise PassError(f"pass '{spec.name}' changed the program(s) {changed}, which its row does not name")
    return model, PassResult(spec.name, rewrites, seconds)


def run_passes(
    model: Model,
    dump_dir: Path | None = None,
    on_pass: Callable[[str], None] | None = None,
    check: bool = False,
    results: list[PassResult] | None = None,
) -> Model:
    """Run the enabled passes in order (appending each one's result to `results`, when given)."""
    if dump_dir is not None:
        dump(model, dump_dir, 0, "trace")
    done: list[str] = []
    for i, spec in enumerate(enabled_passes(model.options), start=1):
        if on_pass:
            on_pass(spec.name)
        try:
            model, result = run_pass(spec, model, check)
        except (UserError, PassError):
            raise
        except Exception as e:
            before = ", ".join(done) or "none"
            raise PassError(
                f"pass '{spec.name}' failed ({type(e).__name__}: {e}); passes run before it: {before}"
            ) from e
        if results is not None:
            results.append(result)
        done.append(spec.name)
        if dump_dir is not None:
            dump(model, dump_dir, i, spec.name)
    return model
