"""Decode/prefill benchmark on one GPU: dsc runtime vs transformers eager vs transformers with
a static cache + torch.compile, on the same random-weight model, in the same run.

    python scripts/bench_decode.py --shape llama-8b --dtype bfloat16 [--int8] [--hf-batches 1,64]

Writes bench_<shape>.json (and a PNG if matplotlib is importable) under $OUT or --out;
scripts/plot_bench.py draws the PNG from the JSON elsewhere.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_decode_ms(model, batch: int, context: int, vocab: int, new_a: int = 8, new_b: int = 40) -> dict:
    """Per-token decode time of model.generate: (time(new_b) - time(new_a)) / (new_b - new_a)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, context), generator=g).to(model.device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n):
        _sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync()
        return time.perf_counter() - t

    t0 = time.perf_counter()
    run(new_a)  # warm-up (and, with torch.compile, compilation)
    first = time.perf_counter() - t0
    run(new_a)
    ta, tb = min(run(new_a) for _ in range(2)), min(run(new_b) for _ in range(2))
    ms = (tb - ta) / (new_b - new_a) * 1e3
    return {"ms_per_step": ms, "tokens_per_s": batch / ms * 1e3, "first_call_s": first}


def hf_prefill_ms(model, n: int, vocab: int) -> float:
    ids = torch.randint(0, vocab, (1, n)).to(model.device)
    with torch.no_grad():
        for _ in range(2):
            model(ids)
        _sync()
        t = time.perf_counter()
        for _ in range(5):
            model(ids)
        _sync()
    return (time.perf_counter() - t) / 5 * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--work", default="/tmp/dsc-bench")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--hf-batches", default="1", help="batches for the transformers baselines")
    ap.add_argument("--hf", default="eager,compile", help="which baselines: eager,compile or none")
    ap.add_argument("--prefill", default="128,2048")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--max-seq", type=int, default=2304,
                    help="clamped to the shape's max_position_embeddings (GPT-2: 1024)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a dry run of the script itself)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile decode at the smallest batch: per-kernel and per-plan-node times")
    args = ap.parse_args()
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint
    from dsc.runtime.bench import bench, render

    work = Path(args.work)
    ckpt = work / f"ckpt-{args.shape}-{args.dtype}"
    tag = f"{args.shape}-{args.dtype}{'-int8' if args.int8 else ''}"
    art = work / f"art-{tag}"
    t = time.perf_counter()
    if not (ckpt / "config.json").exists():
        make_random_checkpoint(ckpt, args.shape, dtype=args.dtype, device=args.device, tokenizer=False)
    print(f"[{tag}] checkpoint ready in {time.perf_counter() - t:.1f}s", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    max_pos = json.loads((ckpt / "config.json").read_text())
    max_pos = max_pos.get("max_position_embeddings") or max_pos.get("n_positions") or args.max_seq
    max_seq = min(args.max_seq, max_pos)
    prefill_lens = [int(p) for p in args.prefill.split(",") if int(p) < max_seq]
    t = time.perf_counter()
    if not (art / "manifest.json").exists():
        dsc.compile(str(ckpt), art, max_batch=max(batches), max_seq=max_seq, int8=args.int8 or None)
    print(f"[{tag}] compiled in {time.perf_counter() - t:.1f}s", flush=True)
    res = {"shape": args.shape, "dtype": args.dtype, "int8": args.int8, "context": args.context}
    res["dsc"] = bench(art, device=args.device, batches=batches, context=args.context,
                       prefill_lens=prefill_lens, profile=args.profile)
    print(render(res["dsc"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{tag}.json").write_text(json.dumps(res, indent=1, default=str))  # saved before baselines
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    baselines = [b for b in args.hf.split(",") if b and b != "none"]
    if baselines and not args.int8:
        from transformers import AutoModelForCausalLM

        for base in baselines:
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, args.dtype)).to(args.device).eval()
            V = model.config.vocab_size
            if base == "compile":
                # transformers' own recipe: a static cache makes generate() torch.compile the
                # forward (reduce-overhead, CUDA graphs) by itself
                model.generation_config.cache_implementation = "static"
            r = {"decode": {}, "prefill": {}}
            for b in [int(x) for x in args.hf_batches.split(",")]:
                try:
                    r["decode"][b] = hf_decode_ms(model, b, args.context, V)
                except Exception as e:  # record and go on: the dsc numbers are already saved
                    r["decode"][b] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                    print(f"[{tag}] transformers {base} batch {b} failed: {r['decode'][b]['error']}", flush=True)
                    continue
                print(f"[{tag}] transformers {base} batch {b}: {r['decode'][b]['ms_per_step']:.3f} ms/step "
                      f"(first call {r['decode'][b]['first_call_s']:.1f}s)", flush=True)
            if base == "eager":
                for n in prefill_lens:
                    r["prefill"][n] = {"ms": hf_prefill_ms(model, n, V)}
            res[f"hf_{base}"] = r
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    # summary table
    lines = [f"\n== {tag} on {res['dsc']['device']} ==",
             f"{'batch':>5} {'dsc ms':>9} {'eager ms':>9} {'compile ms':>10} {'vs eager':>9} {'vs compile':>10} {'dsc %BW':>8}"]
    for b, d in res["dsc"]["decode"].items():
        e = res.get("hf_eager", {}).get("decode", {}).get(b, {}).get("ms_per_step")
        c = res.get("hf_compile", {}).get("decode", {}).get(b, {}).get("ms_per_step")
        f = lambda x: f"{x:.3f}" if x else "-"  # noqa: E731
        r = lambda x: f"{x / d['ms_per_step']:.2f}x" if x else "-"  # noqa: E731
        lines.append(f"{b:>5} {d['ms_per_step']:>9.3f} {f(e):>9} {f(c):>10} {r(e):>9} {r(c):>10} "
                     f"{100 * d['fraction_of_read_bw']:>7.1f}%")
    for n, d in res["dsc"]["prefill"].items():
        e = res.get("hf_eager", {}).get("prefill", {}).get(n, {}).get("ms")
        lines.append(f"prefill {n}: dsc {d['ms']:.2f} ms" + (f", eager {e:.2f} ms ({e / d['ms']:.2f}x)" if e else ""))
    lines.append(f"load + capture: {res['dsc']['load_and_capture_s']:.2f} s")
    for b, d in res.get("hf_compile", {}).get("decode", {}).items():
        if "first_call_s" in d:
            lines.append(f"transformers static cache + torch.compile, batch {b}: first generate (compile) {d['first_call_s']:.1f} s")
    text = "\n".join(lines)
    print(text, flush=True)
    (out / f"bench_{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from plot_bench import plot

        plot([out / f"bench_{tag}.json"], out / f"bench_{tag}.png")
    except ImportError:
        print("matplotlib not available: run scripts/plot_bench.py on the JSON elsewhere")
    return 0


if __name__ == "__main__":
    sys.exit(main())
