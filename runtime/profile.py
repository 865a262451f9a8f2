"""`dsc bench --profile`: where a decode step's time goes, kernel by kernel.

Runs `steps` decode steps (replayed from their CUDA graph where the engine captured one) under
torch.profiler and reports, per step:
  - every kernel (GPU) or op (CPU) by name: launches, microseconds, share of the step;
  - on GPU also each kernel's exposed time: how far it moves the step's end past the kernels
    before it (equal to its own time without overlap; what PDL's early start hides is not in it);
  - busy time (the time at least one kernel ran) against the step's wall time: the difference
    is the time the GPU sat between kernels (launch latency, dependencies), which no faster
    kernel can recover; with PDL kernels overlap (one that starts early counts its wait), which
    the report says, and per-kernel times then include those waits;
  - on GPU, when the kernels of one step line up one-to-one with the plan's launches (the plan
    records each node's kernel and launch count), the time, bytes read and achieved bandwidth
    of every plan node, so a slow matmul or norm is named by its place in the model.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from dsc.runtime.plan import ATTENTION_OPS, GATHER_OPS

READ_BW_H200 = 4.33e12  # bytes/s, measured device read bandwidth (docs/performance.md)


def _weight_bytes(engine, node: dict, targets: dict[str, str]) -> int:
    total = 0
    for a in node.get("args", []):
        ref = a.get("node") if isinstance(a, dict) else None
        name = targets.get(ref) if isinstance(ref, str) else None
        t = engine.weights.get(name) if name else None
        if t is not None:
            total += t.numel() * t.element_size()
    return total


def _plan_launches(engine, batch: int, context: int) -> list[dict]:
    """The decode program's launches in order: one entry per kernel launch of each node."""
    nodes = engine.plan["programs"]["decode"]["nodes"]
    targets = {n["name"]: n["target"] for n in nodes if n["kind"] == "weight"}
    kv = engine.plan.get("kv_cache") or {}
    kv_layer = 0
    if kv:
        _, hkv, _, d = kv["shape"]
        kv_layer = 2 * batch * hkv * context * d * torch.empty((), dtype=getattr(torch, kv["dtype"])).element_size()
    out = []
    for n in nodes:
        k = n.get("kernel") or {}
        launches = int(k.get("launches", 0)) if n["kind"] == "call" else 0
        if not launches:
            continue
        nbytes = _weight_bytes(engine, n, targets) + (kv_layer if n["op"] in ATTENTION_OPS else 0)
        # tables of which a step reads `batch` rows, not the whole (the other weights whole): a
        # gather's table; the rotary tables a rotary_attention with rot_pos reads its rows of
        rows = [0] if n["op"] in GATHER_OPS else []
        if n["op"] == "dsc.rotary_attention.default" and len(n["args"]) > 10 and isinstance(n["args"][10], dict):
            rows = [3, 4]
        for i in rows:
            table = (
                engine.weights.get(targets.get(n["args"][i].get("node"))) if isinstance(n["args"][i], dict) else None
            )
            if table is not None:
                nbytes -= (table.shape[0] - batch) * table[0].numel() * table.element_size()
        for i in range(launches):
            out.append({"node": n["name"], "kernel": k.get("name", n["op"]), "bytes": nbytes if i == 0 else 0})
    return out


def attribute(kernels: list[tuple[str, float]], plan: list[dict], steps: int) -> list[dict] | None:
    """Per plan node: microseconds per step, bytes read, achieved bytes/s, the kernel seen.
    `kernels` are (name, us) in launch order over `steps` steps; None unless every step ran
    exactly the plan's launches (then the i-th kernel of a step is the plan's i-th launch)."""
    if not kernels or not plan or len(kernels) != steps * len(plan):
        return None
    per: dict[str, dict] = {}
    for i, (name, us) in enumerate(kernels):
        p = plan[i % len(plan)]
        row = per.setdefault(
            p["node"],
            {"node": p["node"], "kernel": name, "plan_kernel": p["kernel"], "us": 0.0, "bytes": 0, "launches": 0},
        )
        row["us"] += us / steps
        if i < len(plan):
            row["bytes"] += p["bytes"]
            row["launches"] += 1
    for row in per.values():
        row["bw"] = row["bytes"] / (row["us"] * 1e-6) if row["us"] else 0.0
    return list(per.values())


def _device_events(prof) -> list:
    cuda = torch.autograd.DeviceType.CUDA
    evs = [e for e in prof.events() if e.device_type == cuda]
    return sorted(evs, key=lambda e: e.time_range.start)


def profile_decode(engine, batch: int = 1, context: int = 128, steps: int = 20) -> dict:
    from torch.profiler import ProfilerActivity, profile

    dev = engine.device
    V = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    engine.reset()
    engine.prefill([torch.randint(0, V, (context,), generator=g).tolist() for _ in range(batch)])
    tok = torch.randint(0, V, (batch,), generator=g).to(dev)
    pos = torch.full((batch,), context, dtype=torch.long, device=dev)
    for _ in range(3):
        engine._decode(tok, pos)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine._decode(tok, pos)
        if cuda:
            end.record()
            torch.cuda.synchronize(dev)
            step_us = start.elapsed_time(end) * 1e3 / steps
        else:
            step_us = (time.perf_counter() - t0) * 1e6 / steps
    res: dict = {
        "batch": batch,
        "context": context,
        "steps": steps,
        "step_us": step_us,
        "device": "cuda" if cuda else "cpu",
        "graphs": engine._decode.captured,
    }
    by_name: dict[str, list[float]] = defaultdict(list)
    exposed: dict[str, float] = defaultdict(float)
    if cuda:
        evs = _device_events(prof)
        last_end = float("-inf")
        exposed_each = []
        for e in evs:
            by_name[e.name].append(e.time_range.elapsed_us())
            # exposed: how far this kernel moves the step's end past every earlier kernel's (with
            # PDL a kernel's own time includes its wait for the one before; this does not)
            exposed_each.append(max(0.0, e.time_range.end - max(last_end, e.time_range.start)))
            exposed[e.name] += exposed_each[-1]
            last_end = max(last_end, e.time_range.end)
        if evs and len(evs) % steps == 0:
            res["launches"] = _per_launch(evs, exposed_each, steps)
        res["kernels_per_step"] = len(evs) / steps
        if not evs:
            res["note"] = "the profiler saw no kernels; run with --no-cuda-graphs to profile eager steps"
        res["busy_us"] = _union_us([(e.time_range.start, e.time_range.end) for e in evs]) / steps
        summed = sum(e.time_range.elapsed_us() for e in evs) / steps
        if summed > 1.05 * res["busy_us"]:  # kernels overlap: PDL starts one before its predecessor ends
            res["note"] = (
                f"kernels overlap (PDL: a kernel that starts early counts its wait for the previous "
                f"one): their times sum to {summed:.1f} us per step; for a per-kernel split run with "
                f"DSC_PDL=off"
            )
        plan = _plan_launches(engine, batch, context + 1)
        res["plan_launches_per_step"] = len(plan)
        # the step's own kernels; the copies of tokens and positions into the static buffers
        # (and memsets) are not plan launches
        kernels = [(e.name, e.time_range.elapsed_us()) for e in evs if not e.name.startswith(("Memcpy", "Memset"))]
        nodes = attribute(kernels, plan, steps)
        if nodes is not None:
            res["nodes"] = nodes
    else:
        # CPU: the ops the program dispatched, by self time (children not double counted)
        for e in prof.key_averages():
            if "::" in e.key and e.count >= steps:
                by_name[e.key] = [e.self_cpu_time_total / e.count] * e.count
        res["busy_us"] = sum(sum(v) for v in by_name.values()) / steps
    res["by_name"] = sorted(
        (
            {
                "name": k,
                "launches": len(v) / steps,
                "us": sum(v) / steps,
                **({"exposed_us": exposed[k] / steps} if cuda else {}),
            }
            for k, v in by_name.items()
        ),
        key=lambda r: -r["us"],
    )
    return res


def _per_launch(evs: list, exposed_each: list[float], steps: int) -> list[dict]:
    """The step's kernels in launch order, each averaged over the steps (every step launched the
    same number): name, start (us after the step's first kernel started), own and exposed time.
    Finds which launch of a layer a change moved, where `by_name` sums all of one kernel's."""
    n = len(evs) // steps
    rows = []
    for i in range(n):
        ks = range(i, len(evs), n)
        rows.append(
            {
                "i": i,
                "name": evs[i].name,
                "start_us": sum(evs[k].time_range.start - evs[k - i].time_range.start for k in ks) / steps,
                "us": sum(evs[k].time_range.elapsed_us() for k in ks) / steps,
                "exposed_us": sum(exposed_each[k] for k in ks) / steps,
            }
        )
    return rows


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Time covered by at least one of the (start, end) intervals: busy time when kernels overlap."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def render_profile(res: dict, top: int = 25) -> str:
    what = "kernel" if res["device"] == "cuda" else "op (self CPU time)"
    step = res["step_us"]
    lines = [
        f"profile: decode batch {res['batch']}, context {res['context']}, {res['steps']} steps "
        f"({'CUDA graph replay' if res['graphs'] else 'eager'})",
        f"  step {step:.1f} us; {'kernels busy' if res['device'] == 'cuda' else 'ops'} "
        f"{res['busy_us']:.1f} us ({100 * res['busy_us'] / step:.0f}%); "
        f"{'between kernels' if res['device'] == 'cuda' else 'elsewhere (Python, dispatch)'} "
        f"{max(step - res['busy_us'], 0):.1f} us",
    ]
    if "kernels_per_step" in res:
        lines.append(
            f"  {res['kernels_per_step']:.0f} kernels per step, copies included (the plan counts "
            f"{res['plan_launches_per_step']} launches)"
        )
    if res.get("note"):
        lines.append(f"  {res['note']}")
    gpu = res["device"] == "cuda"
    lines.append(f"  {'us/step':>9} {'%step':>6} {'n/step':>7}{'  exposed' if gpu else ''}  {what}")
    for r in res["by_name"][:top]:
        lines.append(
            f"  {r['us']:>9.1f} {100 * r['us'] / step:>5.1f}% {r['launches']:>7.1f}"
            f"{format(r.get('exposed_us', 0.0), '9.1f') if gpu else ''}  {r['name'][:100]}"
        )
    if res.get("nodes"):
        lines.append(f"  per plan node (slowest first): {'us':>8} {'MB read':>8} {'GB/s':>7} {'% of 4.33 TB/s':>15}")
        for r in sorted(res["nodes"], key=lambda r: -r["us"])[:top]:
            lines.append(
                f"    {r['node'][:48]:<48} {r['us']:>8.1f} {r['bytes'] / 1e6:>8.2f} {r['bw'] / 1e9:>7.0f} "
                f"{100 * r['bw'] / READ_BW_H200:>14.1f}%"
            )
    return "\n".join(lines)
