"""The pass pipeline: one ordered list. Each pass is `name(model) -> model` with its contract
in its docstring (passes/<name>.py).

Why this order:
  canonicalize first, so every later pattern sees one spelling (linear, no casts/dropout);
  bind_kv_cache before anything that rewrites attention shapes, so sharding sees the cache.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from dsc.compiler.ir import Model
from dsc.compiler.serialize import model_to_text, program_nodes
from dsc.errors import PassError, UserError
from dsc.passes.bind_kv_cache import bind_kv_cache
from dsc.passes.canonicalize import canonicalize

Pass = Callable[[Model], Model]


def pipeline(options) -> list[tuple[str, Pass]]:
    """The passes for these options, in order."""
    return [
        ("canonicalize", canonicalize),
        ("bind_kv_cache", bind_kv_cache),
    ]


def dump(model: Model, dump_dir: Path, index: int, name: str) -> None:
    """Write the model after a pass: DIR/NN_name/{graph.txt, plan.json}."""
    d = Path(dump_dir) / f"{index:02d}_{name}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "graph.txt").write_text(model_to_text(model))
    plan = {"programs": {p: {"nodes": program_nodes(g, model.sym_names)} for p, g in model.graphs()},
            "weights": {k: v.describe() for k, v in sorted(model.weights.items())},
            "kv_cache": model.kv_cache, "pass": name,
            "counters": {k: v for k, v in sorted(model.counters.items())}}
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
