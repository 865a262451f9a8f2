"""`dsc bench`: time an artifact with the runtime alone.

Measures load + CUDA-graph capture, decode step time per batch bucket (ms/token at batch 1,
tokens/s at larger batches; each step timed alone from an idle GPU, and steps queued back to
back as `generate` runs them), batch-1 `generate` per token, prefill time per prompt length,
the bytes a decode step must read (matmul weights + the KV cache up to the current context)
and the achieved bandwidth, and the GPU memory split into weights, KV cache and workspace.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dsc.runtime.plan import GATHER_OPS
from dsc.runtime.profile import READ_BW_H200


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def _time_queued(fn, device, reps: int = 10, samples: int = 7) -> float:
    """Median seconds per call over `samples` runs of `reps` calls queued back to back, one host
    sync per run: the step a loop that does not wait for each step runs at (the pipelined
    `generate`). `_time` syncs after every call, so each of its steps starts from an idle GPU;
    under tensor parallelism the ranks' processes then launch each step at slightly different
    times, and a step also absorbs that skew (its first collective waits for the latest rank)."""
    fn()  # the warm-up: one call

    def queued():
        for _ in range(reps):
            fn()

    return _time(queued, device, samples, warmup=0) / reps


def decode_bytes(engine, batch: int, context: int) -> dict[str, int]:
    """Bytes one decode step must read: every weight once, except embedding tables that no
    matmul reads (a gather of `batch` rows) and a mixture of experts' experts (the experts the
    step's tokens are routed to: top_k of E at batch 1; 1 - (1 - top_k/E)^batch of them, the
    expected share under uniform routing, at larger batches), plus K and V of `context`
    positions per sequence per layer."""
    nodes = engine.plan["programs"]["decode"]["nodes"]
    targets = {n["name"]: n["target"] for n in nodes if n["kind"] == "weight"}
    gathered = {targets[n["args"][0]["node"]] for n in nodes if n["kind"] == "call" and n["op"] in GATHER_OPS}
    matmul = {
        targets[a["node"]]
        for n in nodes
        if n["kind"] == "call" and n["op"] not in GATHER_OPS
        for a in n["args"]
        if isinstance(a, dict) and a.get("node") in targets
    }
    experts = {
        targets[a["node"]]
        for n in nodes
        if n["kind"] == "call" and n["op"] == "dsc.moe.default"
        for i, a in enumerate(n["args"])
        if i in (3, 4, 6, 7) and isinstance(a, dict)
    }
    moe = engine.plan["model"].get("experts") or {}
    routed = 1.0 - (1.0 - moe["top_k"] / moe["experts"]) ** batch if experts else 1.0
    weights = 0
    for name, t in engine.weights.items():
        if name in gathered and name not in matmul:
            weights += batch * t[0].numel() * t.element_size()
        elif name in experts:
            weights += int(routed * t.numel() * t.element_size())
        else:
            weights += t.numel() * t.element_size()
    kv = engine.plan.get("kv_cache") or {}
    kvb = 0
    if kv:
        _, hkv, _, d = kv["shape"]
        kvb = (
            2
            * kv["layers"]
            * batch
            * hkv
            * context
            * d
            * torch.empty((), dtype=getattr(torch, kv["dtype"])).element_size()
        )
    return {"weights": weights, "kv_cache": kvb, "total": weights + kvb}


def generate_ms_per_token(engine, context: int, device, g: torch.Generator, short: int = 8, long: int = 40) -> dict:
    """Batch-1 greedy `engine.generate_static` from a `context`-token prompt, per generated token:
    within one run of `long` tokens, the time from token `short` to token `long` (as the host
    receives them, through generate's callback) over the tokens between, the best of 3 runs. Both
    ends are times of the same run, after its prefill and first steps, so no prefill noise enters
    and the time cannot be negative. Sampling, the read-back of each token, the stop checks and every launch
    are in it: what a caller of generate sees, next to the decode step alone."""
    prompt = [torch.randint(0, engine.vocab_size, (context,), generator=g).tolist()]

    def run() -> float:
        seen: list[float] = []
        engine.generate_static(
            prompt, max_new_tokens=long, stop_tokens=[], callback=lambda step, tokens: seen.append(time.perf_counter())
        )
        return (seen[long - 1] - seen[short - 1]) / (long - short)

    run()  # warm-up
    return {"tokens": [short, long], "ms_per_token": min(run() for _ in range(3)) * 1e3}


def bench(
    path: str | Path,
    device: str | None = None,
    batches=(1, 8, 32, 64),
    prefill_lens=(128, 2048),
    context: int = 128,
    iters: int = 50,
    cuda_graphs: bool = True,
    profile: bool = False,
    trust_kernels: bool = False,
) -> dict:
    from dsc.kernels.launch import pdl_enabled
    from dsc.runtime.engine import load

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base_mem = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    engine = load(path, device=dev, verify=False, cuda_graphs=cuda_graphs, trust_kernels=trust_kernels)
    _sync(dev)
    load_s = time.perf_counter() - t0
    res: dict = {
        "artifact": str(path),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": engine.plan["model"]["dtype"],
        "tp": engine.world,
        "load_and_capture_s": load_s,
        "cuda_graphs": engine._decode.captured,
        "all_reduce": engine.all_reduce,
        "pdl": "on" if pdl_enabled(dev) else "off",
        "decode": {},
        "prefill": {},
        "load_stages_s": dict(engine.load_times),
        "kernel_binaries": dict(engine.kernel_binaries),
    }
    if dev.type == "cuda":
        w = sum(t.numel() * t.element_size() for t in engine.weights.values())
        kv = sum(t.numel() * t.element_size() for t in engine.kv_cache.values())
        from dsc.runtime.memory_plan import workspace_bytes

        res["memory"] = {
            "weights": w,
            "kv_cache": kv,
            "workspace": torch.cuda.max_memory_allocated(dev) - base_mem - w - kv,
            "planned_decode_workspace": workspace_bytes(engine.plan, "decode", max(engine.buckets)),
        }
    res["rank"] = engine.rank
    if engine.world > 1:  # every rank's memory, gathered to all
        import torch.distributed as dist

        per_rank = [None] * engine.world
        dist.all_gather_object(per_rank, res.get("memory"))
        res["memory_per_rank"] = per_rank
    V = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    for b in batches:
        if b > engine.max_batch or context + 1 >= engine.max_seq:
            continue
        prompts = [torch.randint(0, V, (context,), generator=g).tolist() for _ in range(b)]
        engine.reset()
        engine.prefill(prompts)
        tok = torch.randint(0, V, (b,), generator=g).to(dev)
        pos = torch.full((b,), context, dtype=torch.long, device=dev)
        step = lambda: engine._decode(tok, pos)  # noqa: E731
        s = _time(step, dev, iters)
        q = _time_queued(step, dev, *((10, 7) if dev.type == "cuda" else (2, 3)))
        nbytes = decode_bytes(engine, b, context + 1)
        res["decode"][b] = {
            "ms_per_step": s * 1e3,
            "ms_per_step_queued": q * 1e3,
            "tokens_per_s": b / s,
            "bytes": nbytes["total"],
            "weight_bytes": nbytes["weights"],
            "kv_bytes": nbytes["kv_cache"],
            "achieved_bw": nbytes["total"] / s,
            "fraction_of_read_bw": nbytes["total"] / s / READ_BW_H200,
        }
    if 1 in res["decode"] and context + 41 < engine.max_seq:
        res["generate"] = generate_ms_per_token(engine, context, dev, g)
    if profile and res["decode"]:
        from dsc.runtime.profile import profile_decode

        res["profile"] = profile_decode(engine, batch=min(res["decode"]), context=context)
    for n in prefill_lens:
        if n >= engine.max_seq:
            continue
        prompt = [torch.randint(0, V, (n,), generator=g).tolist()]
        s = _time(lambda: engine.prefill(prompt), dev, max(3, iters // 10), warmup=1)
        res["prefill"][n] = {
            "ms": s * 1e3,
            "tokens_per_s": n / s,
            "cuda_graph": engine._prefill.graphs and engine._prefill.padded(1, n),
        }
        if res["prefill"][n]["cuda_graph"]:  # the baseline: the same program run eagerly at the exact length
            try:
                e = _time(lambda: engine.prefill(prompt, graphs=False), dev, max(3, iters // 10), warmup=1)
                res["prefill"][n]["eager_ms"] = e * 1e3
            except Exception as err:  # a timing row, never the decode results before it
                res["prefill"][n]["eager_error"] = f"{type(err).__name__}: {err}"[:300]
    if dev.type == "cuda" and res["prefill"]:
        res["memory"]["peak_with_prefill"] = torch.cuda.max_memory_allocated(dev) - base_mem
    return res


def render(res: dict) -> str:
    lines = [
        f"{res['artifact']}  on {res['device']}  {res['dtype']}  tp={res['tp']}  "
        f"cuda_graphs={res['cuda_graphs']}  pdl={res.get('pdl', 'off')}"
        + (f"  all_reduce={res.get('all_reduce')}" if res["tp"] > 1 else ""),
        f"load + capture: {res['load_and_capture_s']:.2f} s ("
        + ", ".join(f"{k} {v:.2f}" for k, v in res.get("load_stages_s", {}).items() if k != "total")
        + f"; kernel binaries: {res.get('kernel_binaries', {}).get('status', 'none')})",
    ]
    if "memory" in res:
        m = res["memory"]
        lines.append(
            f"GPU memory: weights {m['weights'] / 2**30:.2f} GiB, KV cache {m['kv_cache'] / 2**30:.2f} GiB, "
            f"workspace {m['workspace'] / 2**20:.1f} MiB (memory plan for the largest decode bucket: "
            f"{m['planned_decode_workspace'] / 2**20:.1f} MiB)"
        )
    for r, m in enumerate(res.get("memory_per_rank") or []):
        if m:
            lines.append(
                f"  rank {r}: weights {m['weights'] / 2**30:.2f} GiB, KV cache {m['kv_cache'] / 2**30:.2f} GiB, "
                f"workspace {m['workspace'] / 2**20:.1f} MiB"
            )
    lines.append(
        f"{'batch':>6} {'ms/step':>9} {'queued':>8} {'tok/s':>10} {'MB read':>9} {'GB/s':>8} {'% of 4.33 TB/s':>15}"
    )
    for b, d in res["decode"].items():
        queued = f"{d['ms_per_step_queued']:>8.3f}" if "ms_per_step_queued" in d else f"{'-':>8}"
        lines.append(
            f"{b:>6} {d['ms_per_step']:>9.3f} {queued} {d['tokens_per_s']:>10.1f} {d['bytes'] / 1e6:>9.1f} "
            f"{d['achieved_bw'] / 1e9:>8.1f} {100 * d['fraction_of_read_bw']:>14.1f}%"
        )
    if res["decode"]:
        lines.append(
            "  (ms/step: each step alone, synced after it; queued: steps queued back to back, as generate runs them)"
        )
    if res.get("generate") and 1 in res["decode"]:
        lines.append(
            f"generate, batch 1, greedy: {res['generate']['ms_per_token']:.3f} ms/token "
            f"(the decode step alone: {res['decode'][1]['ms_per_step']:.3f} ms)"
        )
    for n, d in res["prefill"].items():
        lines.append(
            f"prefill {n:>5} tokens: {d['ms']:.2f} ms ({d['tokens_per_s']:.0f} tok/s)"
            + (
                f", CUDA graph; eager {d['eager_ms']:.2f} ms ({d['eager_ms'] / d['ms']:.2f}x)"
                if "eager_ms" in d
                else ""
            )
            + (f"; eager failed: {d['eager_error']}" if "eager_error" in d else "")
        )
    if "peak_with_prefill" in res.get("memory", {}):
        lines.append(f"GPU memory after the prefills: {res['memory']['peak_with_prefill'] / 2**30:.2f} GiB at peak")
    if res.get("profile"):
        from dsc.runtime.profile import render_profile

        lines.append(render_profile(res["profile"]))
    return "\n".join(lines)
