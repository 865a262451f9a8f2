"""Kernel launches of a planned program, counted from its plan nodes (JSON data, no torch).

Shared by the compiler (plan_kernels' summary in the manifest) and `dsc inspect`."""

from __future__ import annotations

import re
from collections import Counter

_LAYER = re.compile(r"^(.*?\.\d+)\.")


def layer_of(node_name: str) -> str | None:
    """model.layers.3.self_attn.qkv_proj.linear -> model.layers.3 (None outside the layers)."""
    m = _LAYER.match(node_name)
    return m.group(1) if m else None


def launches(calls: list[dict]) -> dict:
    """Kernel launches of one run of a program (its plan's call nodes), in all and per layer."""
    planned = [n for n in calls if "kernel" in n]
    per_layer: dict[str, int] = {}
    seq: dict[str, list[str]] = {}
    by_kernel: Counter = Counter()
    for n in planned:
        k = n["kernel"]
        by_kernel[k["name"]] += k["launches"]
        layer = layer_of(n["name"])
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + k["launches"]
            if k["launches"]:
                seq.setdefault(layer, []).append(k["name"] + (f" x{k['launches']}" if k["launches"] > 1 else ""))
    total = sum(k["launches"] for k in (n["kernel"] for n in planned))
    last = list(per_layer)[-1] if per_layer else None
    return {
        "launches": total,
        "launches_by_kernel": dict(sorted(by_kernel.items())),
        "layers": len(per_layer),
        "launches_per_layer": max(per_layer.values(), default=0),
        "launches_outside_layers": total - sum(per_layer.values()),
        "layer_kernels": {"layer": last, "kernels": seq.get(last, [])} if last else None,
    }
