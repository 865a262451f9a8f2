"""The pass pipeline: one ordered list. Each pass is `name(model) -> model` with its contract
in its docstring (passes/<name>.py).

Why this order:
  canonicalize first, so every later pattern sees one spelling (linear, no casts/dropout);
  bind_kv_cache before anything that rewrites attention shapes, so sharding sees the cache;
  shard_tensor_parallel before the fusions, so a fused q/k/v concatenation combines the
  per-projection shards (blocks per source) instead of splitting the fused matrix as one block;
  fusions (options.fuse): projections first, so swiglu reads the fused gate_up output; the
  int8 pass after them, so it quantizes the fused weights;
  fold_position_tables after the fusions (fuse_rotary reads the cos/sin it replaces by lookups);
  fuse_rotary_attention (a fusion, decode only) after sharding and fold_position_tables, so it
  fuses the rank's final rotary + attention pair, with cos/sin already table lookups;
  select_decode_token (decode only) before decode_linears, so lm_head's linear reads a view;
  decode_linears after every pass that matches aten.linear (it renames the decode and ragged
  programs' linears);
  plan_kernels last, so it plans the ops every other pass left.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

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


def pipeline(options) -> list[tuple[str, Pass]]:
    """The passes for these options, in order."""
    return (
        [
            ("canonicalize", canonicalize),
            ("bind_kv_cache", bind_kv_cache),
            ("shard_tensor_parallel", shard_tensor_parallel),  # no-op for tp == 1
        ]
        + (FUSIONS if options.fuse else [])
        + [
            *(
                [("quantize_int8", quantize_int8)]
                if options.int8 or options.fp8 or options.int4 or options.auto_precision is not None
                else []
            ),
            ("fold_position_tables", fold_position_tables),
            *([("fuse_rotary_attention", fuse_rotary_attention)] if options.fuse else []),
            ("select_decode_token", select_decode_token),
            ("decode_linears", decode_linears),
            ("plan_kernels", plan_kernels),
        ]
    )


FUSIONS: list[tuple[str, Pass]] = [
    ("fuse_projections", fuse_projections),
    ("fuse_add_norm", fuse_add_norm),
    ("fuse_rotary", fuse_rotary),
    ("fuse_activation", fuse_activation),
]


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


def run_passes(model: Model, dump_dir: Path | None = None, on_pass: Callable[[str], None] | None = None) -> Model:
    passes = pipeline(model.options)
    if dump_dir is not None:
        dump(model, dump_dir, 0, "trace")
    done: list[str] = []
    for i, (name, fn) in enumerate(passes, start=1):
        if on_pass:
            on_pass(name)
        try:
            model = fn(model)
            for _, g in model.graphs():
                g.lint()
        except UserError:
            raise
        except Exception as e:
            before = ", ".join(done) or "none"
            raise PassError(f"pass '{name}' failed ({type(e).__name__}: {e}); passes run before it: {before}") from e
        done.append(name)
        if dump_dir is not None:
            dump(model, dump_dir, i, name)
    return model
