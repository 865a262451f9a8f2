"""`dsc inspect`: what an artifact holds, read from its manifest, plan and rank headers.

JSON and the standard library only (no torch): `dsc inspect` answers in a fraction of a second."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from dsc.launch_counts import launches
from dsc.runtime.artifact import open_artifact
from dsc.runtime.offload import offload_line


def cache_readers(program: dict) -> list[dict]:
    """The program's call nodes that take a KV-cache tensor (weight nodes whose target is
    `kv_cache.<layer>.k|v`, as the runtime names the cache): its attentions, one per layer."""
    caches = {
        n["name"]
        for n in program["nodes"]
        if n["kind"] == "weight" and str(n.get("target", "")).startswith("kv_cache.")
    }
    return [
        n
        for n in program["nodes"]
        if n["kind"] == "call" and any(isinstance(a, dict) and a.get("node") in caches for a in n.get("args", []))
    ]


def describe(
    path: str | Path,
    require_signature: str | Path | None = None,
    offload: str | None = None,
    gpu_memory: float | None = None,
    pipeline_parallel_size: int = 1,
) -> dict:
    """What `dsc inspect` shows. Reads the manifest, plan and rank headers (each checked as the
    loader checks them, docs/security.md), no tensor; checksums only with require_signature.
    With `offload` (and `gpu_memory` GiB), where each rank's weights would live at load
    (runtime/offload.py); with `pipeline_parallel_size`, each stage's layers and bytes
    (runtime/pipeline.py)."""
    from dsc.runtime.offload import check_offload, data_start, plan_offload

    check_offload(offload, gpu_memory)
    art = open_artifact(path, ranks=[], verify=False, require_signature=require_signature)
    stages = _stages(art, pipeline_parallel_size) if pipeline_parallel_size != 1 else None
    plan, man = art.plan, art.manifest
    programs = {}
    for name, p in plan["programs"].items():
        calls = [n for n in p["nodes"] if n["kind"] == "call"]
        ops = Counter(n["op"] for n in calls)
        kernels = Counter(n["kernel"]["name"] for n in calls if "kernel" in n)
        programs[name] = {
            "nodes": len(p["nodes"]),
            "calls": len(calls),
            "ops": dict(sorted(ops.items())),
            "kernels": dict(sorted(kernels.items())),
            **launches(calls),
        }
    ranks: dict[int, dict] = {}
    expert_bytes, other_bytes, placements = 0, 0, {}
    for r in range(art.tp):
        f = art.rank_file(r)
        if not f.exists():
            ranks[r] = {"missing": True}
            continue
        h = {k: v for k, v in art.rank_header(r).items() if k != "__metadata__"}
        if offload is not None:
            budget = None if gpu_memory is None else int(gpu_memory * 2**30)
            placements[r] = plan_offload(h, data_start(f), budget, offload, path=str(f)).summary()
        by_dtype: Counter = Counter()
        for name, info in h.items():
            lo, hi = info["data_offsets"]
            by_dtype[info["dtype"]] += hi - lo
            if ".experts." in name:
                expert_bytes += hi - lo
            else:
                other_bytes += hi - lo
        ranks[r] = {"tensors": len(h), "bytes": f.stat().st_size, "bytes_by_dtype": dict(sorted(by_dtype.items()))}
    from dsc.runtime.memory_plan import workspace_bytes

    attn = cache_readers(plan["programs"].get("decode", {"nodes": []}))
    windows = Counter(_window(n) for n in attn)
    buckets = plan["limits"].get("decode_buckets") or [plan["limits"]["max_batch"]]
    workspace = {b: workspace_bytes(plan, "decode", b) for b in buckets} if "decode" in plan["programs"] else {}
    source = man.get("source")
    return {
        "path": str(path),
        "decode_buckets": buckets,
        "decode_workspace": workspace,
        "format_version": man["format_version"],
        "versions": man.get("versions"),
        "source": (source if isinstance(source, dict) else {}).get("model"),
        "model_type": plan["model"]["model_type"],
        "dtype": plan["model"]["dtype"],
        "tp": plan["tp"],
        "options": man.get("options"),
        "limits": plan["limits"],
        "kv_cache": plan.get("kv_cache"),
        "programs": programs,
        "attention_windows": {str(w): c for w, c in sorted(windows.items())},
        "attention_variants": {v: c for v, c in sorted(Counter(score_variant(n) for n in attn).items()) if v},
        "ranks": ranks,
        "passes": plan.get("passes", {}),
        "notes": plan.get("notes", {}),
        "experts": _experts(plan["model"].get("experts"), expert_bytes, other_bytes),
        "kind": plan["model"].get("kind", "decoder"),
        "pooling": plan["model"].get("pooling"),
        "extra": {k: man[k] for k in ("int8_report",) if isinstance(man.get(k), dict)},
        "kernel_binaries": describe_binaries(art),
        "offload": placements or None,
        "stages": stages,
    }


def _stages(art, pp: int) -> list[dict]:
    """Where pipeline stages would cut the ragged program: each stage's layers, the tensors it
    reads from rank file 0 and their bytes, the values it receives."""
    from dsc.runtime.pipeline import check_stages, split_layers, stage_program

    check_stages(art.plan, pp, str(art.path))
    nodes = art.plan["programs"]["ragged"]["nodes"]
    header = art.rank_header(0)
    split = split_layers(nodes, header, pp)
    out = []
    for s in range(pp):
        sp = stage_program(nodes, split, s)
        layers = [k for k, t in split.items() if t == s]
        nbytes = sum(header[w]["data_offsets"][1] - header[w]["data_offsets"][0] for w in sp.weights if w in header)
        out.append(
            {
                "stage": s,
                "layers": [layers[0], layers[-1]],
                "count": len(layers),
                "bytes": nbytes,
                "receives": len(sp.recv),
            }
        )
    return out


_CUBIN = re.compile(r"kernels/(?P<kernel>[A-Za-z0-9_]+)-[0-9a-f]{16}\.(?P<target>sm_\d{2,3})\.cubin")


def describe_binaries(art) -> dict | None:
    """The artifact's kernel binaries (`dsc compile --target`), from the manifest's file list:
    per target their count and bytes, per kernel its binaries per target, and the kernels the
    compile left to Triton (with why); None without binaries."""
    if "kernels/binaries.json" not in art.manifest["files"]:
        return None
    targets: dict[str, dict] = {}
    kernels: dict[str, dict] = {}
    for rel in art.manifest["files"]:
        m = _CUBIN.fullmatch(rel)
        if m is None:
            continue
        t = targets.setdefault(m["target"], {"binaries": 0, "bytes": 0})
        t["binaries"] += 1
        t["bytes"] += (art.path / rel).stat().st_size
        k = kernels.setdefault(m["kernel"], {})
        k[m["target"]] = k.get(m["target"], 0) + 1
    summary = art.manifest.get("kernel_binaries")
    skipped = summary.get("skipped") if isinstance(summary, dict) else None
    return {
        "targets": dict(sorted(targets.items())),
        "kernels": dict(sorted(kernels.items())),
        "skipped": {str(k): str(v) for k, v in skipped.items()} if isinstance(skipped, dict) else {},
    }


def _experts(facts, expert_bytes: int, other_bytes: int) -> dict | None:
    """A mixture of experts: its experts per rank, and the weight bytes one token reads over
    all ranks (every non-expert weight, top_k of the experts of each MoE layer)."""
    if not isinstance(facts, dict):
        return None
    experts, top_k = facts.get("experts"), facts.get("top_k")
    out = {k: facts.get(k) for k in ("experts", "top_k", "per_rank", "placement")}
    if type(experts) is int and type(top_k) is int and 0 < top_k <= experts:
        out["expert_bytes"] = expert_bytes
        out["active_bytes_per_token"] = other_bytes + expert_bytes * top_k // experts
    return out


def _window(node: dict) -> int:
    """An attention node's sliding window (0: full attention)."""
    w = (node.get("kernel") or {}).get("config", {}).get("window", 0)
    return w if type(w) is int and w >= 0 else 0


def score_variant(node: dict) -> str:
    """An attention node's score variant as its kernel config records it ("" where none):
    "softcap 50", "ALiBi" or both, joined by " + "."""
    cfg = (node.get("kernel") or {}).get("config", {})
    cap = cfg.get("softcap")
    parts = [f"softcap {cap:g}"] if type(cap) in (int, float) and 0 < cap < 1e300 else []
    return " + ".join(parts + (["ALiBi"] if cfg.get("alibi") is True else []))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def render(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(markup=False)  # artifact text is shown as it is, never read as rich markup
    c.print(info["path"], style="bold", end="")
    c.print(
        f"  {info['model_type']}  {info['dtype']}  tp={info['tp']}  "
        f"(source {info['source']}, format v{info['format_version']})"
    )
    c.print(f"options: {json.dumps(info['options'], sort_keys=True)}")
    if info.get("kind") == "encoder":
        pooling = info.get("pooling")
        pool = pooling if isinstance(pooling, dict) else {}
        c.print(
            f"kind: encoder (embeddings): program encode runs right-padded rows to their last hidden states; "
            f"pooling {pool.get('mode')}{', L2-normalized' if pool.get('normalize') else ''} "
            f"(from {pool.get('source')})"
        )
    else:
        c.print("kind: decoder: prefill and decode (static cache), ragged (continuous batching over the paged cache)")
    kv = info["kv_cache"]
    if kv:
        c.print(f"kv cache: {kv['layers']} layers x 2 x {kv['shape']} {kv['dtype']}")
    windows = {int(w): n for w, n in info.get("attention_windows", {}).items()}
    if any(windows):
        c.print(
            "attention: "
            + ", ".join(
                f"{n} layer{'s' * (n != 1)} " + (f"sliding window {w}" if w else "full")
                for w, n in sorted(windows.items())
            )
        )
    variants = info.get("attention_variants", {})
    if variants:
        c.print("attention scores: " + ", ".join(f"{n} layer{'s' * (n != 1)} {v}" for v, n in variants.items()))
    moe = info.get("experts")
    if moe:
        line = (
            f"experts: {moe['experts']} per MoE layer, {moe['top_k']} routed per token; {moe['per_rank']} "
            f"per rank ({moe['placement']})"
        )
        if "active_bytes_per_token" in moe:
            line += (
                f"; a token reads {_fmt_bytes(moe['active_bytes_per_token'])} of weights "
                f"(experts hold {_fmt_bytes(moe['expert_bytes'])})"
            )
        c.print(line)
    c.print(
        "decode buckets (CUDA graphs): "
        + ", ".join(f"{b} (workspace {_fmt_bytes(w)})" for b, w in info["decode_workspace"].items())
    )
    for name, p in info["programs"].items():
        t = Table(title=f"program {name}: {p['calls']} ops", show_lines=False)
        t.add_column("op")
        t.add_column("count", justify="right")
        for op, n in sorted(p["ops"].items(), key=lambda x: -x[1]):
            t.add_row(op, str(n))
        c.print(t)
        if p["kernels"]:
            k = Table(title=f"program {name}: kernels")
            k.add_column("kernel")
            k.add_column("count", justify="right")
            k.add_column("launches", justify="right")
            for kn, n in sorted(p["kernels"].items(), key=lambda x: -x[1]):
                k.add_row(kn, str(n), str(p["launches_by_kernel"].get(kn, "")))
            c.print(k)
            c.print(
                f"program {name}: {p['launches']} kernel launches per step"
                + (" (decode: at the smallest batch bucket)" if name == "decode" else "")
                + (
                    f"; {p['launches_per_layer']} per layer x {p['layers']} layers"
                    f" + {p['launches_outside_layers']} outside the layers"
                    if p["layers"]
                    else ""
                )
            )
            if p.get("layer_kernels"):
                c.print(f"  one layer ({p['layer_kernels']['layer']}): " + ", ".join(p["layer_kernels"]["kernels"]))
    bins = info.get("kernel_binaries")
    if bins:
        targets = list(bins["targets"])
        k = Table(
            title="kernel binaries (dsc compile --target): "
            + ", ".join(f"{t} {d['binaries']} ({_fmt_bytes(d['bytes'])})" for t, d in bins["targets"].items())
        )
        k.add_column("kernel")
        for t in targets:
            k.add_column(t, justify="right")
        for name, per in bins["kernels"].items():
            k.add_row(name, *(str(per.get(t, 0)) for t in targets))
        c.print(k)
        for name, why in bins["skipped"].items():
            c.print(f"kernel {name}: no binary ({why}); compiled with Triton at run time")
    for st in info.get("stages") or []:
        c.print(
            f"pipeline stage {st['stage']}: {st['count']} layers ({st['layers'][0]} .. {st['layers'][1]}), "
            f"{_fmt_bytes(st['bytes'])} per rank, {st['receives']} tensors received per step"
        )
    for rank, placed in (info.get("offload") or {}).items():
        c.print(f"rank {rank}: " + offload_line(placed))
    r = Table(title="rank files")
    r.add_column("rank")
    r.add_column("tensors", justify="right")
    r.add_column("bytes", justify="right")
    r.add_column("by dtype")
    for rank, d in info["ranks"].items():
        if d.get("missing"):
            r.add_row(str(rank), "-", "missing", "")
        else:
            r.add_row(
                str(rank),
                str(d["tensors"]),
                _fmt_bytes(d["bytes"]),
                ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in d["bytes_by_dtype"].items()),
            )
    c.print(r)
    if info["passes"]:
        p = Table(title="pass rewrites")
        p.add_column("pass.rule")
        p.add_column("count", justify="right")
        for k, v in info["passes"].items():
            p.add_row(k, str(v))
        c.print(p)
    for k, v in info.get("notes", {}).items():
        c.print(f"note {k}: {v}")
    rep = info.get("extra", {}).get("int8_report")
    if rep:
        try:
            lines = int8_summary(rep)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError):  # a hand-edited manifest
            lines = ["int8 report: malformed in manifest.json (see --json)"]
        for line in lines:
            c.print(line, highlight=False)


def int8_summary(rep: dict) -> list[str]:
    """The manifest's int8 report in a few lines (compiler/int8_report.py writes it)."""
    mem, ws = rep["memory"], rep["weight_sqnr_db"]
    scheme = rep["mode"] + (f", group {rep['group_size']}" if rep.get("group_size") else ", per-channel")
    scheme += (", symmetric" if rep["symmetric"] else ", asymmetric") + (
        ", SmoothQuant" if rep.get("smoothquant") else ""
    )
    name = rep["mode"] if rep["mode"] in ("fp8", "int4") else "mixed" if rep["mode"] == "auto" else "int8"
    if name == "fp8":
        scheme = "e4m3, per-channel weights, per-token activations"
    elif name == "int4":
        scheme = f"w4a16, group {rep.get('group_size')}, scale and min per group"
    elif name == "mixed":
        c = ((rep.get("auto_precision") or {}).get("rounds") or [{}])[-1].get("counts") or {}
        scheme = (
            f"auto-precision: {c.get('int4', 0)} int4, {c.get('int8', 0)} int8, {c.get('16-bit', 0)} 16-bit linears"
        )
    if "logits" in rep:
        lg = rep["logits"]
        out = [
            f"{name} ({scheme}): logits SQNR {lg['sqnr_db']:.1f} dB, KL {lg['kl_div']:.2e}, "
            f"top-1 agreement {lg['top1_agreement']:.1%} over {lg['positions']} positions"
        ]
    else:  # an encoder's
        lg = rep["hidden_states"]
        out = [
            f"{name} ({scheme}): hidden-state SQNR {lg['sqnr_db']:.1f} dB, lowest cosine {lg['min_cosine']:.5f} "
            f"over {lg['positions']} tokens"
        ]
    if ws.get("worst"):
        out.append("  worst weight SQNR: " + ", ".join(f"{k} {v:.1f} dB" for k, v in ws["worst"][:3]))
    out.append(
        f"  quantized linear weights: {_fmt_bytes(mem['int8_bytes'])} {name} + {_fmt_bytes(mem['scale_bytes'])} "
        f"scales/zeros, {_fmt_bytes(mem['bytes_16bit'])} at 16 bits "
        f"({(mem['int8_bytes'] + mem['scale_bytes']) / max(mem['bytes_16bit'], 1):.0%})"
    )
    return out
