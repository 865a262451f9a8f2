"""The serving engine at the GPU's limit: one mixed workload through dsc.LLM's engine (async and
sync scheduling, a token-budget sweep), through `dsc serve` with the `openai` client, batch 1
against the static path, and the load time by stage. Each part runs in its own process.

    python scripts/bench_engine.py all --shape llama-8b --dtype bfloat16          # on an H200
    python scripts/bench_engine.py all --shape llama-tiny --device cpu --requests 12 \\
        --prompt-lens 8,64 --output-lens 4,16 --budgets 64,256 --batch1-new 8     # a dry run on the CPU

Workload: --requests prompts of random token ids, lengths drawn uniformly from --prompt-lens,
outputs from --output-lens (eos ignored), all queued at once. The compute floor is the
workload's matmul and attention FLOPs at --peak-tflops (a bf16 matmul's measured rate on an
H200). Prints a table; writes bench_engine.json (and the profiles) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["all", "prepare", "offline", "http", "batch1", "load"])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--prompt-lens", default="32,2048")
    ap.add_argument("--output-lens", default="32,512")
    ap.add_argument("--budgets", default="512,2048,8192", help="max_num_batched_tokens values of the sweep")
    ap.add_argument("--sync-budget", type=int, default=512, help="the budget also run with sync scheduling")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--profile-budgets", default="", help="budgets whose steps are profiled (torch.profiler)")
    ap.add_argument("--batch1-prompt", type=int, default=128)
    ap.add_argument("--batch1-new", type=int, default=256)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--parts", default="offline,batch1,load,http", help="what `all` runs")
    ap.add_argument("--work", default="build/bench", help="where the checkpoint and artifact are kept")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap.parse_args(argv)


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def artifact_path(args) -> Path:
    (_, phi), (_, ohi) = _pair(args.prompt_lens), _pair(args.output_lens)
    return Path(args.work) / f"engine-{args.shape}-{args.dtype}-{phi + ohi + 1}"


def prepare(args) -> Path:
    import torch

    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    work = Path(args.work)
    ckpt = work / f"ckpt-{args.shape}-{args.dtype}"
    art = artifact_path(args)
    (_, phi), (_, ohi) = _pair(args.prompt_lens), _pair(args.output_lens)
    t = time.perf_counter()
    if not (ckpt / "config.json").exists():
        make_random_checkpoint(
            ckpt, args.shape, dtype=args.dtype, tokenizer=False, device="cuda" if torch.cuda.is_available() else "cpu"
        )
    if not (art / "manifest.json").exists():
        dsc.compile(str(ckpt), art, max_batch=8, max_seq=max(phi + ohi + 1, args.batch1_prompt + args.batch1_new + 1))
    print(f"checkpoint and artifact ready in {time.perf_counter() - t:.1f}s", flush=True)
    return art


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    (plo, phi), (olo, ohi) = _pair(args.prompt_lens), _pair(args.output_lens)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(plo, phi))], rng.randint(olo, ohi))
        for _ in range(args.requests)
    ]


def workload_flops(engine, reqs) -> float:
    """Matmul FLOPs (2 per weight of the layers' linears per token, the lm_head's per generated
    token; a mixture of experts' experts top_k / E of theirs: the experts a token is routed to)
    and attention FLOPs (4 x head_dim x query heads x layers per (token, cached token) pair)."""
    moe = engine.plan["model"].get("experts") or {}
    routed = moe["top_k"] / moe["experts"] if moe else 1.0
    layer = head = 0
    q_rows = None
    for name, w in engine.weights.items():
        if w.dim() != 2 or "embed" in name:
            continue
        if name.startswith("lm_head"):
            head += w.numel()
        else:
            layer += w.numel() * (routed if ".experts." in name else 1.0)
            if q_rows is None and "qkv_proj" in name:
                q_rows = w.shape[0]
    pool = engine.plan["kv_pool"]
    kv = pool["kv_heads"] * pool["head_dim"]
    q_dim = (q_rows - 2 * kv) * engine.world if q_rows else kv
    layer, head = layer * engine.world, head * engine.world
    flops = 0.0
    for prompt, n in reqs:
        total = len(prompt) + n
        flops += 2 * layer * total + 2 * head * n + 4 * q_dim * pool["layers"] * total * (total + 1) / 2
    return flops


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(llm_engine, reqs, profile_to: Path | None = None) -> dict:
    from dsc.runtime.llm import SamplingParams

    for i, (p, n) in enumerate(reqs):
        llm_engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    dev = llm_engine.engine.device
    _sync(dev)
    if profile_to is not None:
        import torch

        for _ in range(5):
            llm_engine.step()
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []
        )
        with torch.profiler.profile(activities=acts) as prof:
            t = time.perf_counter()
            steps = 20
            for _ in range(steps):
                llm_engine.step()
            _sync(dev)
            wall = time.perf_counter() - t
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        profile_to.write_text(f"{steps} steps in {wall:.3f} s\n" + prof.key_averages().table(sort_by=key, row_limit=25))
        for rid in list(llm_engine._requests):
            llm_engine.abort_request(rid)
        while llm_engine.core.has_work():
            llm_engine.core.step()
        return {"profile_steps": steps, "profile_wall_s": wall}
    s0 = dict(llm_engine.stats())
    launches = []  # (time, tokens, sequences) of every step launched
    executor = llm_engine.core.executor
    launch = executor.launch

    def traced(plan):
        launches.append((time.perf_counter(), len(plan.step.input_ids), len(plan.step.query_lens)))
        return launch(plan)

    executor.launch = traced
    t = time.perf_counter()
    gen = 0
    try:
        while llm_engine.has_unfinished_requests():
            for out in llm_engine.step():
                if out.finished:
                    gen += len(out.outputs[0].token_ids)
        _sync(dev)
    finally:
        executor.launch = launch
    wall = time.perf_counter() - t
    assert gen == sum(n for _, n in reqs), "every request gets its max_tokens (eos ignored)"
    stats = llm_engine.stats()
    steps = stats["steps"] - s0["steps"]
    return {
        "wall_s": wall,
        "generated_tokens": gen,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "gen_tok_s": gen / wall,
        "steps": steps,
        "ms_per_step": 1e3 * wall / max(steps, 1),
        "preemptions": stats["preemptions"] - s0["preemptions"],
        "by_step_kind": by_kind(launches, t + wall),
    }


def by_kind(launches, end: float) -> dict:
    """Steps by kind (decode only; mixed of up to MAX_TOKENS tokens, the largest captured; larger
    mixed), with the seconds from each launch to the next (the step's device time, when the
    device is the bottleneck) and the tokens they computed."""
    from dsc.runtime.ragged import MAX_TOKENS

    out: dict = {}
    for i, (t0, T, N) in enumerate(launches):
        t1 = launches[i + 1][0] if i + 1 < len(launches) else end
        kind = "decode" if T == N else f"mixed<={MAX_TOKENS}" if T <= MAX_TOKENS else f"mixed>{MAX_TOKENS}"
        k = out.setdefault(kind, {"steps": 0, "s": 0.0, "tokens": 0, "seqs": 0})
        k["steps"] += 1
        k["s"] += t1 - t0
        k["tokens"] += T
        k["seqs"] += N
    return out


def part_offline(args) -> dict:
    import torch

    import dsc
    from dsc.runtime.llm import LLMEngine

    device = torch.device(args.device) if args.device else None
    engine = dsc.load(artifact_path(args), device=device, static=False, max_num_seqs=args.max_num_seqs)
    reqs = workload(args, engine.vocab_size)
    res = {"flops": workload_flops(engine, reqs), "runs": {}}
    configs = [(b, True) for b in map(int, args.budgets.split(","))] + [(args.sync_budget, False)]
    for budget, async_ in configs:
        eng = LLMEngine(engine=engine, max_num_batched_tokens=budget, async_scheduling=async_)
        name = f"budget {budget}{'' if async_ else ', sync'}"
        res["runs"][name] = r = run_engine(eng, reqs)
        r["floor_ratio"] = res["flops"] / (args.peak_tflops * 1e12) / r["wall_s"]
        print(
            f"{name}: {r['wall_s']:.2f} s, {r['gen_tok_s']:.0f} generated tok/s, {r['steps']} steps, "
            f"{100 * r['floor_ratio']:.0f}% of the compute floor",
            flush=True,
        )
    for budget in filter(None, args.profile_budgets.split(",")):
        eng = LLMEngine(engine=engine, max_num_batched_tokens=int(budget))
        run_engine(eng, reqs, profile_to=Path(args.out) / f"profile-budget{budget}.txt")
    return res


def part_batch1(args) -> dict:
    import torch

    import dsc
    from dsc.runtime.llm import LLMEngine

    device = torch.device(args.device) if args.device else None
    engine = dsc.load(artifact_path(args), device=device, kv_cache_memory=4.0, max_num_seqs=8)
    prompt = [1 + i % 97 for i in range(args.batch1_prompt)]
    n = args.batch1_new

    def static():
        engine.generate_static([prompt], max_new_tokens=n, stop_tokens=[])

    def paged(async_):
        eng = LLMEngine(engine=engine, async_scheduling=async_)
        return lambda: _drain(eng, prompt, n)

    out = {}
    if args.profile_budgets:
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        for name, fn in (
            ("static", lambda: engine.generate_static([prompt], max_new_tokens=64, stop_tokens=[])),
            ("paged", lambda: _drain(LLMEngine(engine=engine), prompt, 64)),
        ):
            fn()
            _sync(engine.device)
            with torch.profiler.profile(activities=acts) as prof:
                fn()
                _sync(engine.device)
            (Path(args.out) / f"profile-batch1-{name}.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            )
    for name, fn in (("static", static), ("dsc.LLM", paged(True)), ("dsc.LLM sync", paged(False))):
        fn()
        _sync(engine.device)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            _sync(engine.device)
            times.append(time.perf_counter() - t)
        out[name] = 1e3 * min(times) / n
    out["ratio"] = out["dsc.LLM"] / out["static"]
    print(
        f"batch 1, {args.batch1_prompt}-token prompt, {n} new: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()),
        flush=True,
    )
    return out


def _drain(eng, prompt, n):
    from dsc.runtime.llm import SamplingParams

    eng.add_request("b1", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()


def part_load(args) -> dict:
    import torch

    from dsc.runtime.llm import LLM

    device = torch.device(args.device) if args.device else None
    t = time.perf_counter()
    llm = LLM(artifact_path(args), device=device, max_num_seqs=args.max_num_seqs)
    total = time.perf_counter() - t
    stages = dict(llm.engine.load_times)
    print(f"dsc.LLM ready in {total:.1f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)
    return {"ready_s": total, "stages": stages}


def part_http(args) -> dict:
    import socket

    from dsc.serve.bench import BenchConfig, Lengths, run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "dsc",
        "serve",
        str(artifact_path(args)),
        "--port",
        str(port),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-queue",
        str(10 * args.requests),
    ]
    if args.device:
        cmd += ["--device", args.device]
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    try:
        url = f"http://127.0.0.1:{port}/v1"
        _wait_ready(url, proc)
        (plo, phi), (olo, ohi) = _pair(args.prompt_lens), _pair(args.output_lens)
        cfg = BenchConfig(
            url=url,
            rates=[float("inf")],
            num_requests=args.requests,
            prompt_len=Lengths.parse(f"{plo}:{phi}", "--prompt-len"),
            output_len=Lengths.parse(f"{olo}:{ohi}", "--output-len"),
        )
        procs = {"api": proc.pid, **{f"engine{i}": c for i, c in enumerate(_children(proc.pid))}}
        before, client0, t0 = {k: _cpu_s(v) for k, v in procs.items()}, time.process_time(), time.perf_counter()
        res = run(cfg)
        wall = time.perf_counter() - t0
        # where the host time goes: each process's CPU seconds over the run's wall time (1.0: one
        # core busy all along, the most a process's Python thread can give)
        res["cpu_share"] = {
            **{k: round((_cpu_s(v) - before[k]) / wall, 3) for k, v in procs.items()},
            "client": round((time.process_time() - client0) / wall, 3),
            "wall_s": round(wall, 2),
        }
        print(f"cpu share over the HTTP run: {res['cpu_share']}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    r = res["rates"][0] if "rates" in res else res
    print(f"dsc serve: {json.dumps(r)[:400]}", flush=True)
    return res


def _children(pid: int) -> list[int]:
    """The processes whose parent is pid (dsc serve's engine process), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return sorted(out)


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (0 once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_ready(url: str, proc, timeout: float = 300) -> None:
    import urllib.request

    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"dsc serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise SystemExit("dsc serve did not become ready")


PARTS = {"offline": part_offline, "batch1": part_batch1, "load": part_load, "http": part_http}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "prepare":
        prepare(args)
        return 0
    if args.part in PARTS:
        res = PARTS[args.part](args)
        (out / f"bench_engine_{args.part}.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    prepare(args)
    results = {}
    argv = sys.argv[2:] if argv is None else argv[1:]
    for part in args.parts.split(","):  # a part named twice runs twice ("load,load": a cold, then a warm start)
        rc = subprocess.run([sys.executable, __file__, part, *argv]).returncode
        f = out / f"bench_engine_{part}.json"
        key = part if part not in results else f"{part} again"
        results[key] = json.loads(f.read_text()) if rc == 0 and f.exists() else {"failed": rc}
        f.unlink(missing_ok=True)
    (out / "bench_engine.json").write_text(json.dumps(results, indent=1, default=str))
    print(render(results), flush=True)
    return 0


def render(results: dict) -> str:
    lines = []
    off = results.get("offline", {})
    if "runs" in off:
        lines += [
            f"workload: {off['flops'] / 1e15:.2f} PFLOP",
            "| path | wall s | generated tok/s | steps | % of floor |",
            "|---|---|---|---|---|",
        ]
        for name, r in off["runs"].items():
            lines.append(
                f"| dsc.LLM engine, {name} | {r['wall_s']:.2f} | {r['gen_tok_s']:.0f} | {r['steps']} | "
                f"{100 * r['floor_ratio']:.0f}% |"
            )
    b1 = results.get("batch1", {})
    if "ratio" in b1:
        lines.append(
            f"batch 1 ms/token: static {b1['static']:.3f}, dsc.LLM {b1['dsc.LLM']:.3f} ({b1['ratio']:.3f}x), "
            f"sync {b1['dsc.LLM sync']:.3f}"
        )
    for key in ("load", "load again"):
        ld = results.get(key, {})
        if "ready_s" in ld:
            lines.append(
                f"dsc.LLM ready ({key}) in {ld['ready_s']:.1f} s: "
                + ", ".join(f"{k} {v:.2f}" for k, v in ld["stages"].items())
            )
    ht = results.get("http", {})
    if ht.get("rates"):
        r = ht["rates"][0]
        lines.append(f"dsc serve + openai client: {json.dumps(r)[:600]}")
        if "cpu_share" in ht:
            lines.append(f"CPU share of each process over the HTTP run (1.0 = one core all along): {ht['cpu_share']}")
    for part, r in results.items():
        if "failed" in r:
            lines.append(f"{part}: failed (exit {r['failed']})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
