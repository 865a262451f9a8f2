"""Offline serving benchmark: a mixed workload through dsc.LLM (continuous batching) against
today's static-batch generate on the same requests, in the same run.

    python scripts/bench_serving.py --shape llama-8b --dtype bfloat16 [--int8]      # on a GPU
    python scripts/bench_serving.py --shape llama-tiny --device cpu --requests 24 \\
        --prompt-lens 8,64 --output-lens 4,16 --static-batch 8 --steps 1,4,8      # a dry run on the CPU

Requests: prompts of uniformly drawn lengths (--prompt-lens LO,HI, random token ids) and
output lengths (--output-lens LO,HI; eos ignored: the weights are random), all queued at once.
Reports, as a table and bench_serving_<tag>.json under $OUT or --out:
  - throughput (generated tokens/s and all tokens/s) of `dsc.LLM.generate` over all requests,
    and of `Engine.generate_static` over the same requests in arrival-order batches of
    --static-batch (each batch runs until its longest output is done; only each request's own
    tokens count), and their ratio;
  - the decode-only step time (a CUDA-graph replay on GPU) at --steps running sequences, each
    with --context tokens in the paged cache, next to the static decode step at the static
    batch size;
  - how many sequences run at once in the KV memory of a static [static batch, --kv-seq]
    cache, when prompts are short (--short-prompt tokens, --short-output new), against the
    static batch size.
The checkpoint and artifacts are kept under --work and reused by later runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt-lens", default="32,2048")
    ap.add_argument("--output-lens", default="32,512")
    ap.add_argument("--static-batch", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of the scheduler")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--steps", default="1,8,32,64,128", help="running sequences of the decode-step timing")
    ap.add_argument("--context", type=int, default=512, help="tokens per sequence in the decode-step timing")
    ap.add_argument("--kv-seq", type=int, default=2304, help="max_seq of the static cache the KV memory matches")
    ap.add_argument("--short-prompt", type=int, default=128)
    ap.add_argument("--short-output", type=int, default=128)
    ap.add_argument("--skip-static", action="store_true", help="no static-batch baseline")
    ap.add_argument("--work", default="build/bench", help="where the checkpoint and artifacts are kept")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap.parse_args(argv)


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare(args, max_seq: int) -> tuple[Path, str]:
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    work = Path(args.work)
    ckpt = work / f"ckpt-{args.shape}-{args.dtype}"
    tag = f"{args.shape}-{args.dtype}{'-int8' if args.int8 else ''}"
    art = work / f"serve-{tag}-{args.static_batch}x{max_seq}"
    t = time.perf_counter()
    if not (ckpt / "config.json").exists():
        make_random_checkpoint(
            ckpt, args.shape, dtype=args.dtype, tokenizer=False, device="cuda" if torch.cuda.is_available() else "cpu"
        )
    if not (art / "manifest.json").exists():
        dsc.compile(str(ckpt), art, max_batch=args.static_batch, max_seq=max_seq, int8=args.int8 or None)
    print(f"[{tag}] checkpoint and artifact ready in {time.perf_counter() - t:.1f}s", flush=True)
    return art, tag


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    (plo, phi), (olo, ohi) = _pair(args.prompt_lens), _pair(args.output_lens)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(plo, phi))], rng.randint(olo, ohi))
        for _ in range(args.requests)
    ]


def run_llm(llm, reqs) -> dict:
    from dsc.runtime.llm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
    peak = {"running": 0}

    def on_out(_):
        peak["running"] = max(peak["running"], llm.engine.scheduler.stats()["num_running"])

    dev = llm.engine.engine.device
    _sync(dev)
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, callback=on_out)
    _sync(dev)
    wall = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == sum(n for _, n in reqs), "every request gets its max_tokens (eos ignored)"
    prompt = sum(len(p) for p, _ in reqs)
    return {
        "wall_s": wall,
        "generated_tokens": gen,
        "prompt_tokens": prompt,
        "gen_tok_s": gen / wall,
        "all_tok_s": (gen + prompt) / wall,
        "peak_running": peak["running"],
        "stats": llm.engine.stats(),
    }


def run_static(engine, reqs, batch: int) -> dict:
    dev = engine.device
    _sync(dev)
    t = time.perf_counter()
    gen = 0
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        res = engine.generate_static([p for p, _ in chunk], max_new_tokens=max(n for _, n in chunk), stop_tokens=[])
        gen += sum(min(len(t), n) for t, (_, n) in zip(res.tokens, chunk))
    _sync(dev)
    wall = time.perf_counter() - t
    prompt = sum(len(p) for p, _ in reqs)
    return {"wall_s": wall, "generated_tokens": gen, "gen_tok_s": gen / wall, "all_tok_s": (gen + prompt) / wall}


def _median_ms(fn, dev: torch.device, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def decode_step_ms(engine, n: int, context: int) -> float:
    """A decode-only ragged step of n sequences with `context` cached tokens each (the pool's
    first blocks, reused across sequences: the same bytes read as distinct blocks)."""
    from dsc.runtime.ragged import Step, pack

    bs = engine.plan["kv_pool"]["block_size"]
    pool_blocks = next(iter(engine.kv_pool.values())).shape[0]
    nb = -(-(context + 1) // bs)
    step = Step()
    for i in range(n):
        table = [(i * nb + j) % pool_blocks for j in range(nb)]
        step.query_start.append(i)
        step.query_lens.append(1)
        step.cache_lens.append(context)
        step.block_tables.append(table)
        step.input_ids.append(i + 1)
        step.positions.append(context)
        step.slot_mapping.append(table[context // bs] * bs + context % bs)
        step.logits_idx.append(i)
    packed = pack(step)
    return _median_ms(lambda: engine.ragged(packed), engine.device)


def static_step_ms(engine, n: int, context: int) -> float:
    tok = torch.ones(n, dtype=torch.long, device=engine.device)
    pos = torch.full((n,), context, dtype=torch.long, device=engine.device)
    return _median_ms(lambda: engine._decode(tok, pos), engine.device)


def kv_bytes_static(plan: dict, batch: int, seq: int) -> int:
    from dsc.runtime.ragged import pool_block_bytes

    pool = plan["kv_pool"]
    return pool_block_bytes(pool) * batch * seq // pool["block_size"]


def main(argv=None) -> int:
    args = parse_args(argv)
    import dsc
    from dsc.runtime.llm import LLM

    (_, phi), (_, ohi) = _pair(args.prompt_lens), _pair(args.output_lens)
    max_seq = max(phi + ohi, args.kv_seq, args.short_prompt + args.short_output) + 1
    art, tag = prepare(args, max_seq)
    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    steps = [int(s) for s in args.steps.split(",")]
    res: dict = {
        "shape": args.shape,
        "dtype": args.dtype,
        "int8": args.int8,
        "requests": args.requests,
        "prompt_lens": args.prompt_lens,
        "output_lens": args.output_lens,
        "budget": args.budget,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }

    # 1. continuous batching, mixed workload, and its decode-only steps
    t = time.perf_counter()
    llm = LLM(art, device=device, max_num_seqs=max(args.max_num_seqs, max(steps)), max_num_batched_tokens=args.budget)
    res["load_s"] = time.perf_counter() - t
    reqs = workload(args, llm.engine.vocab_size)
    res["llm"] = run_llm(llm, reqs)
    print(f"[{tag}] dsc.LLM: {res['llm']['gen_tok_s']:.0f} generated tok/s ({res['llm']['wall_s']:.1f} s)", flush=True)
    context = min(args.context, max_seq - 2)
    res["context"] = context
    res["decode_step_ms"] = {n: decode_step_ms(llm.engine.engine, n, context) for n in steps}
    plan = llm.engine.engine.plan
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 2. concurrency in the KV memory of a static cache, short prompts
    kv = kv_bytes_static(plan, args.static_batch, args.kv_seq)
    llm = LLM(
        art, device=device, max_num_seqs=4096, max_num_batched_tokens=max(args.budget, 2048), kv_cache_memory=kv / 2**30
    )
    short = [([1 + i % 97] * args.short_prompt, args.short_output) for i in range(16 * args.static_batch)]
    conc = run_llm(llm, short)
    res["kv_concurrency"] = {
        "kv_bytes": kv,
        "static_batch": args.static_batch,
        "peak_running": conc["peak_running"],
        "ratio": conc["peak_running"] / args.static_batch,
    }
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 3. today's static-batch generate on the same requests
    if not args.skip_static:
        engine = dsc.load(art, device=device, kv_cache_memory=0.01, max_num_seqs=1)
        res["static"] = run_static(engine, reqs, args.static_batch)
        res["static_step_ms"] = static_step_ms(engine, min(args.static_batch, engine.max_batch), context)
        res["throughput_ratio"] = res["llm"]["gen_tok_s"] / res["static"]["gen_tok_s"]
        del engine
    print(render(res, tag), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_serving_{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


def render(res: dict, tag: str) -> str:
    lines = [
        f"## {tag}: {res['requests']} requests, prompts {res['prompt_lens']}, outputs {res['output_lens']}, "
        f"budget {res['budget']} tokens/step, on {res['device']}",
        "| | generated tok/s | all tok/s | wall s |",
        "|---|---|---|---|",
    ]
    for name, key in (
        ("dsc.LLM (continuous batching)", "llm"),
        ("static generate, batches in arrival order", "static"),
    ):
        if key in res:
            r = res[key]
            lines.append(f"| {name} | {r['gen_tok_s']:.0f} | {r['all_tok_s']:.0f} | {r['wall_s']:.1f} |")
    if "throughput_ratio" in res:
        lines.append(f"throughput ratio (dsc.LLM / static): {res['throughput_ratio']:.2f}x")
    steps = " | ".join(f"{n}: {ms:.3f}" for n, ms in res["decode_step_ms"].items())
    lines.append(f"decode-only step, ms by running sequences: {steps}")
    if "static_step_ms" in res:
        lines.append(
            f"static decode step at batch {res['kv_concurrency']['static_batch']}: {res['static_step_ms']:.3f} ms"
        )
    c = res["kv_concurrency"]
    lines.append(
        f"sequences at once in the KV memory of a {c['static_batch']}-row static cache: {c['peak_running']} "
        f"({c['ratio']:.1f}x)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
