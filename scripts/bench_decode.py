"""Decode/prefill benchmark on one GPU: dsc runtime vs transformers eager vs transformers with
a static cache + torch.compile, on the same random-weight model, in the same run; or this
checkout's `dsc bench` against another checkout's on the same artifact.

    python scripts/bench_decode.py --shape llama-8b --dtype bfloat16 [--int8] [--hf-batches 1,64]
    python scripts/bench_decode.py --shape llama-8b --int8 --batches 1 --baseline .base   # A/B against the checkout
    in .base
    python scripts/bench_decode.py --shape llama-8b --int8 --batches 1 --prepare          # checkpoint + artifact only
    python scripts/bench_decode.py --plot bench_llama-8b-bfloat16.json ... [-o bench.png]  # draw saved results
    python scripts/bench_decode.py --shape llama-tiny --device cpu --hf none              # a dry run on the CPU

The checkpoint and artifact are kept under --work and reused by later runs of the same shape.
Writes bench_<tag>.json (and bench_<tag>.png if matplotlib is importable) under $OUT or --out.
--baseline DIR: DIR holds another dsc checkout (e.g. a copy of main). Each side's `dsc bench`
runs in its own process, with PYTHONPATH starting at a folder whose `dsc` links to that
checkout, on the same artifact (compiled by this checkout; --baseline-artifact own compiles one
with DIR's code too, for a format the two do not share), in interleaved rounds (this, base, then
base, this, ...). Prints the median over rounds of each side's queued ms/step (steps queued back
to back, as generate runs them) per batch and their ratio; writes ab_<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
NO_PREFILL = 1 << 30  # a `dsc bench --prefill` length past every artifact's max_seq: no prefill rows


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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--work", default="/tmp/dsc-bench")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--hf-batches", default="1", help="batches for the transformers baselines")
    ap.add_argument("--hf", default="eager,compile", help="which baselines: eager,compile or none")
    ap.add_argument("--prefill", default="128,2048")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument(
        "--max-seq", type=int, default=2304, help="clamped to the shape's max_position_embeddings (GPT-2: 1024)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a dry run of the script itself)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile decode at the smallest batch: per-kernel and per-plan-node times",
    )
    ap.add_argument("--baseline", type=Path, help="another dsc checkout: `dsc bench` of both on the same artifact")
    ap.add_argument(
        "--baseline-artifact",
        choices=["same", "own"],
        default="same",
        help="own: the baseline runs an artifact compiled by its own code",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the --baseline comparison")
    ap.add_argument("--prepare", action="store_true", help="only make the checkpoint and compile the artifact")
    ap.add_argument("--plot", nargs="+", type=Path, metavar="JSON", help="only draw these saved results (-o: the PNG)")
    ap.add_argument("-o", dest="png", type=Path, default=Path("bench.png"), help="the PNG of --plot")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return 0
    if args.baseline and not (args.baseline / "runtime" / "bench.py").is_file():
        print(f"error: --baseline: {args.baseline} holds no dsc checkout (no runtime/bench.py)", file=sys.stderr)
        return 2
    ckpt, art, tag = prepare(args)
    if args.prepare:
        return 0
    if args.baseline:
        return compare(args, art, tag)
    from dsc.runtime.bench import bench, render

    res = {"shape": args.shape, "dtype": args.dtype, "int8": args.int8, "context": args.context}
    res["dsc"] = bench(
        art,
        device=args.device,
        batches=batches_of(args),
        context=args.context,
        prefill_lens=prefill_lens_of(args, ckpt),
        profile=args.profile,
    )
    print(render(res["dsc"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{tag}.json").write_text(json.dumps(res, indent=1, default=str))  # saved before baselines
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    hf_baselines(args, res, ckpt, tag)
    print(summary(res, tag), flush=True)
    (out / f"bench_{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    try:
        plot([out / f"bench_{tag}.json"], out / f"bench_{tag}.png")
    except ImportError:
        print(f"matplotlib not available: run `scripts/bench_decode.py --plot {out / f'bench_{tag}.json'}` elsewhere")
    return 0


def batches_of(args) -> list[int]:
    return [int(b) for b in args.batches.split(",")]


def max_seq_of(args, ckpt: Path) -> int:
    config = json.loads((ckpt / "config.json").read_text())
    return min(args.max_seq, config.get("max_position_embeddings") or config.get("n_positions") or args.max_seq)


def prefill_lens_of(args, ckpt: Path) -> list[int]:
    return [int(p) for p in args.prefill.split(",") if int(p) < max_seq_of(args, ckpt)]


def prepare(args) -> tuple[Path, Path, str]:
    """(checkpoint, artifact, tag): the random checkpoint and this checkout's artifact under
    --work, each made where missing."""
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    work = Path(args.work)
    ckpt = work / f"ckpt-{args.shape}-{args.dtype}"
    tag = f"{args.shape}-{args.dtype}{'-int8' if args.int8 else ''}"
    art = work / f"art-{tag}"
    t = time.perf_counter()
    if not (ckpt / "config.json").exists():
        make_random_checkpoint(ckpt, args.shape, dtype=args.dtype, device=args.device, tokenizer=False)
    print(f"[{tag}] checkpoint ready in {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    if not (art / "manifest.json").exists():
        dsc.compile(
            str(ckpt), art, max_batch=max(batches_of(args)), max_seq=max_seq_of(args, ckpt), int8=args.int8 or None
        )
    print(f"[{tag}] compiled in {time.perf_counter() - t:.1f}s", flush=True)
    return ckpt, art, tag


def hf_baselines(args, res: dict, ckpt: Path, tag: str) -> None:
    """transformers eager and static cache + torch.compile on the same checkpoint, into res."""
    baselines = [b for b in args.hf.split(",") if b and b != "none"]
    if not baselines or args.int8:
        return
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
            except Exception as e:  # noqa: BLE001  record and go on: the dsc numbers are already saved
                r["decode"][b] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                print(f"[{tag}] transformers {base} batch {b} failed: {r['decode'][b]['error']}", flush=True)
                continue
            print(
                f"[{tag}] transformers {base} batch {b}: {r['decode'][b]['ms_per_step']:.3f} ms/step "
                f"(first call {r['decode'][b]['first_call_s']:.1f}s)",
                flush=True,
            )
        if base == "eager":
            for n in prefill_lens_of(args, ckpt):
                r["prefill"][n] = {"ms": hf_prefill_ms(model, n, V)}
        res[f"hf_{base}"] = r
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def summary(res: dict, tag: str) -> str:
    """The table of dsc against the transformers baselines."""
    lines = [
        f"\n== {tag} on {res['dsc']['device']} ==",
        f"{'batch':>5} {'dsc ms':>9} {'eager ms':>9} {'compile ms':>10} {'vs eager':>9} {'vs compile':>10} "
        f"{'dsc %BW':>8}",
    ]
    for b, d in res["dsc"]["decode"].items():
        e = res.get("hf_eager", {}).get("decode", {}).get(b, {}).get("ms_per_step")
        c = res.get("hf_compile", {}).get("decode", {}).get(b, {}).get("ms_per_step")
        f = lambda x: f"{x:.3f}" if x else "-"  # noqa: E731
        r = lambda x: f"{x / d['ms_per_step']:.2f}x" if x else "-"  # noqa: E731
        lines.append(
            f"{b:>5} {d['ms_per_step']:>9.3f} {f(e):>9} {f(c):>10} {r(e):>9} {r(c):>10} "
            f"{100 * d['fraction_of_read_bw']:>7.1f}%"
        )
    for n, d in res["dsc"]["prefill"].items():
        e = res.get("hf_eager", {}).get("prefill", {}).get(n, {}).get("ms")
        lines.append(f"prefill {n}: dsc {d['ms']:.2f} ms" + (f", eager {e:.2f} ms ({e / d['ms']:.2f}x)" if e else ""))
    lines.append(f"load + capture: {res['dsc']['load_and_capture_s']:.2f} s")
    for b, d in res.get("hf_compile", {}).get("decode", {}).items():
        if "first_call_s" in d:
            lines.append(
                f"transformers static cache + torch.compile, batch {b}: "
                f"first generate (compile) {d['first_call_s']:.1f} s"
            )
    return "\n".join(lines)


# -- --baseline: this checkout's `dsc bench` against another's -------------------------------------
def link_folder(checkout: Path, name: str) -> Path:
    """A new folder holding only `dsc` -> checkout, to put first on a child's PYTHONPATH."""
    folder = Path(tempfile.mkdtemp(prefix=f"dsc-{name}-pkg-"))
    (folder / "dsc").symlink_to(checkout.resolve(), target_is_directory=True)
    return folder


def child_env(checkout: Path, name: str) -> dict:
    """os.environ with PYTHONPATH starting at checkout's link folder (and no interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(link_folder(checkout, name)), env.get("PYTHONPATH", "")) if p)
    return env


def run_child(cmd: list[str], env: dict) -> None:
    """cmd in its own process, from a neutral folder (no checkout shadows the linked `dsc`)."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode:
        raise SystemExit(
            f"error: {' '.join(cmd)} (PYTHONPATH={env['PYTHONPATH']}) exited {proc.returncode}:\n" + proc.stderr[-3000:]
        )


def dsc_bench(env: dict, art: Path, args, out: Path) -> dict:
    """One `python -m dsc bench` at --batches, without prefill rows: its JSON results."""
    run_child(
        [
            sys.executable,
            "-m",
            "dsc",
            "bench",
            str(art),
            "--device",
            args.device,
            "--prefill",
            str(NO_PREFILL),
            "--context",
            str(args.context),
            "--json",
            str(out),
            *(a for b in batches_of(args) for a in ("--batch", str(b))),
        ],
        env,
    )
    res = json.loads(out.read_text())
    out.unlink()
    return res


def compare(args, art: Path, tag: str) -> int:
    """This checkout's `dsc bench` against --baseline's, interleaved rounds on the same GPU."""
    envs = {"this": child_env(ROOT, "this"), "base": child_env(args.baseline, "base")}
    arts = {"this": art, "base": art}
    if args.baseline_artifact == "own":
        arts["base"] = Path(f"{art}-base")
        if not (arts["base"] / "manifest.json").exists():
            ckpt = Path(args.work) / f"ckpt-{args.shape}-{args.dtype}"
            run_child(
                [
                    sys.executable,
                    "-m",
                    "dsc",
                    "compile",
                    str(ckpt),
                    "-o",
                    str(arts["base"].resolve()),
                    "--max-batch",
                    str(max(batches_of(args))),
                    "--max-seq",
                    str(max_seq_of(args, ckpt)),
                    *(["--int8"] if args.int8 else []),
                ],
                envs["base"],
            )
    for side, env in envs.items():  # which code each side imports, for the record
        where = subprocess.run(
            [sys.executable, "-c", "import dsc, os; print(os.path.realpath(dsc.__file__))"],
            env=env,
            capture_output=True,
            text=True,
            cwd=tempfile.gettempdir(),
        ).stdout.strip()
        print(f"[{tag}] {side}: dsc from {where}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict = {"this": [], "base": []}
    for r in range(args.rounds):
        for side in ("this", "base") if r % 2 == 0 else ("base", "this"):
            res = dsc_bench(envs[side], arts[side].resolve(), args, (out / f"ab_{tag}_{side}.json").resolve())
            runs[side].append(res)
            print(
                f"[{tag}] round {r + 1} {side}: "
                + ", ".join(
                    f"batch {b} {d['ms_per_step_queued']:.4f} ms/step queued" for b, d in res["decode"].items()
                ),
                flush=True,
            )
    table = {}
    for b in runs["this"][0]["decode"]:
        ms = {side: statistics.median(x["decode"][b]["ms_per_step_queued"] for x in rs) for side, rs in runs.items()}
        table[b] = {"this_ms": ms["this"], "base_ms": ms["base"], "this_over_base": ms["this"] / ms["base"]}
    print(
        f"\n== {tag} on {runs['this'][0]['device']}: this checkout ({ROOT}) against --baseline "
        f"({args.baseline.resolve()}); queued ms/step, median of {args.rounds} rounds ==\n"
        f"{'batch':>5} {'this ms':>9} {'base ms':>9} {'this/base':>9}\n"
        + "\n".join(
            f"{b:>5} {t['this_ms']:>9.4f} {t['base_ms']:>9.4f} {t['this_over_base']:>9.4f}" for b, t in table.items()
        ),
        flush=True,
    )
    (out / f"ab_{tag}.json").write_text(
        json.dumps(
            {
                "tag": tag,
                "baseline": str(args.baseline.resolve()),
                "artifacts": {k: str(v) for k, v in arts.items()},
                "table": table,
                "runs": runs,
            },
            indent=1,
            default=str,
        )
    )
    return 0


# -- --plot --------------------------------------------------------------------------------------------
def plot(files: list[Path], out: Path) -> None:
    """Decode latency and throughput against batch, from saved bench_<tag>.json files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for f in files:
        r = json.loads(Path(f).read_text())
        tag = f"{r['shape']} {r['dtype']}{' int8' if r.get('int8') else ''}"
        for key, style in (("dsc", "-o"), ("hf_eager", "--s"), ("hf_compile", ":^")):
            d = r["dsc"]["decode"] if key == "dsc" else r.get(key, {}).get("decode", {})
            d = {int(b): v for b, v in d.items() if "ms_per_step" in v}
            if not d:
                continue
            bs = sorted(d)
            axes[0].plot(bs, [d[b]["ms_per_step"] for b in bs], style, label=f"{tag} {key}")
            axes[1].plot(bs, [d[b]["tokens_per_s"] for b in bs], style, label=f"{tag} {key}")
    axes[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="ms per decode step", title="decode latency")
    axes[1].set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="decode throughput")
    for a in axes:
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
