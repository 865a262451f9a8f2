"""Benchmark (not a test): compile time and peak RSS of `dsc compile` for random checkpoints, at
tp 1 and N.

    python scripts/bench_compile.py                                   # llama-1b and llama-8b, bf16, tp 1
    python scripts/bench_compile.py --shapes llama-1b --tp 1 4        # tp 4 against tp 1
    python scripts/bench_compile.py --shapes llama-8b --dir /big/disk --keep --json out.json

For each shape it writes a random-weight checkpoint (streamed, tensor by tensor; the 8B shape is
~16 GB on disk) in a child process, runs `python -m dsc compile CKPT -o OUT --tp N` as a child per
tp, and reads that child's own peak RSS from os.wait4 (ru_maxrss). This script never imports
torch: Linux carries the parent's peak RSS into a forked child's ru_maxrss across exec, so a fat
parent would inflate every number. Checkpoints and artifacts are deleted afterwards unless
--keep. The compiler's contract: peak RSS stays a small multiple of the largest tensor, whatever
the model size (target for the 8B shape: <= 3 GB), and tp=N's peak RSS stays within one tensor
(the largest in the checkpoint) of tp=1's, each rank file about total/N plus the replicated parts.
Exit 1 when a tp=N compile exceeds that bound.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def python(code: str, *args: str) -> str:
    """Run code in a child interpreter (torch stays out of this process); its stdout."""
    return subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True).stdout


def checkpoint_bytes(shape: str, dtype_bytes: int) -> int:
    """Size on disk of a random checkpoint of this shape, from its config alone."""
    return int(python("import sys; from dsc.compiler.random_checkpoint import SHAPES\n"
                      "f = SHAPES[sys.argv[1]][1]; h, i, v, n = (f[k] for k in ('hidden_size', 'intermediate_size', "
                      "'vocab_size', 'num_hidden_layers'))\n"
                      "hd = f.get('head_dim') or h // f['num_attention_heads']\n"
                      "kv, q = f['num_key_value_heads'] * hd, f['num_attention_heads'] * hd\n"
                      "emb = v * h * (1 if f.get('tie_word_embeddings') else 2)\n"
                      "print((n * (h * q * 2 + h * kv * 2 + 3 * h * i + 2 * h) + emb + h) * int(sys.argv[2]))",
                      shape, str(dtype_bytes)))


def largest_tensor(ckpt: Path) -> tuple[str, int]:
    """(name, bytes) of the checkpoint's largest tensor, read from the safetensors headers."""
    best = ("", 0)
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                lo, hi = info["data_offsets"]
                best = max(best, (name, hi - lo), key=lambda x: x[1])
    return best


def run_compile(ckpt: Path, out: Path, tp: int, dtype: str) -> dict:
    """`dsc compile` as a child: wall and CPU seconds, its own peak RSS, the rank files' sizes."""
    cmd = [sys.executable, "-m", "dsc", "compile", str(ckpt), "-o", str(out), "--tp", str(tp), "--dtype", dtype]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read().decode()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.stderr.close()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    ranks = {f.name: f.stat().st_size for f in sorted(out.glob("rank*.safetensors"))}
    return {"tp": tp, "wall_s": round(wall, 1), "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "rank_files": ranks, "command": " ".join(cmd)}


def bench(shape: str, dtype: str, tps: list[int], workdir: Path, keep: bool) -> dict:
    need = (1 + len(tps)) * checkpoint_bytes(shape, 4 if dtype == "fp32" else 2) + 2 * 2**30  # + artifacts + slack
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(f"error: --dir: {workdir} has {free / GB:.1f} GB free, {shape} needs {need / GB:.1f} GB")
    ckpt = workdir / f"ckpt-{shape}-{dtype}"
    arts = [workdir / f"art-{shape}-tp{tp}" for tp in tps]
    try:
        if not (ckpt / "config.json").exists():
            t0 = time.perf_counter()
            python("import sys; from dsc.compiler.random_checkpoint import make_random_checkpoint as m; "
                   "m(sys.argv[1], sys.argv[2], dtype=sys.argv[3])", str(ckpt), shape, DTYPES[dtype])
            print(f"{shape}: checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
        name, big = largest_tensor(ckpt)
        src = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        runs = []
        for tp, art in zip(tps, arts):
            r = run_compile(ckpt, art, tp, dtype)
            runs.append(r)
            sizes = list(r["rank_files"].values())
            print(f"{shape} tp={tp}: {r['wall_s']:7.1f} s wall, {r['cpu_s']:7.1f} s cpu, peak RSS "
                  f"{r['peak_rss_bytes'] / GB:.2f} GB, rank files {min(sizes) / GB:.3f}-{max(sizes) / GB:.3f} GB each",
                  flush=True)
        base = next((r for r in runs if r["tp"] == 1), None)
        within = {r["tp"]: r["peak_rss_bytes"] <= base["peak_rss_bytes"] + big for r in runs if base and r["tp"] > 1}
        return {"shape": shape, "dtype": dtype, "source_bytes": src, "largest": name, "largest_bytes": big,
                "runs": runs, "within_one_tensor_of_tp1": within}
    finally:
        if not keep:
            for path in (ckpt, *arts):
                shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes (1 first: the baseline)")
    ap.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and artifacts")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="dsc-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [bench(s, args.dtype, args.tp, workdir, args.keep) for s in args.shapes]
    if not args.dir and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{'shape':<10} {'tp':>3} {'ckpt GB':>8} {'compile s':>10} {'peak RSS GB':>12} "
          f"{'largest tensor':>36} {'GB':>6} {'RSS/largest':>12} {'tp=N - tp=1 RSS':>16}")
    for r in rows:
        base = next((x for x in r["runs"] if x["tp"] == 1), None)
        for x in r["runs"]:
            delta = f"{(x['peak_rss_bytes'] - base['peak_rss_bytes']) / GB:+.2f} GB" if base and x["tp"] > 1 else "-"
            ok = r["within_one_tensor_of_tp1"].get(x["tp"], True)
            print(f"{r['shape']:<10} {x['tp']:>3} {r['source_bytes'] / GB:>8.2f} {x['wall_s']:>10.1f} "
                  f"{x['peak_rss_bytes'] / GB:>12.2f} {r['largest']:>36} {r['largest_bytes'] / GB:>6.2f} "
                  f"{x['peak_rss_bytes'] / r['largest_bytes']:>12.1f} {delta:>16}{'' if ok else '  EXCEEDS one tensor'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(all(r["within_one_tensor_of_tp1"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
