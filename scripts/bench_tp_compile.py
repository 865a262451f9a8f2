"""Time and peak RSS of `dsc compile --tp N` against tp=1 for a random-weight checkpoint.

    python scripts/bench_tp_compile.py                       # llama-1b, bf16, tp 1 and 4
    python scripts/bench_tp_compile.py --shape llama-tiny --tp 1 2 4 --work /tmp/b

Each compile runs as its own `dsc compile` process; its peak RSS comes from wait4's rusage
of that process alone. This script never imports torch and makes the checkpoint in a child
process: Linux carries the parent's peak RSS into a forked child's ru_maxrss across exec, so
a fat parent would inflate every number. The claim checked: streaming emit keeps tp=N's peak RSS within one
tensor (the largest in the checkpoint) of tp=1's, and each rank file holds about total/N plus
the replicated parts.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path


def largest_tensor_bytes(ckpt: Path) -> tuple[str, int]:
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
    cmd = [sys.executable, "-m", "dsc", "compile", str(ckpt), "-o", str(out), "--tp", str(tp), "--dtype", dtype]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode()
    p.stderr.close()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    ranks = {f.name: f.stat().st_size for f in sorted(out.glob("rank*.safetensors"))}
    return {"tp": tp, "wall_s": round(wall, 1), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "rank_files": ranks, "command": " ".join(cmd)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsc-bench-tp"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    ckpt = args.work / f"ckpt-{args.shape}-{args.dtype}"
    if not (ckpt / "config.json").exists():
        t0 = time.perf_counter()
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[args.dtype]
        subprocess.run([sys.executable, "-c", "import sys; from dsc.compiler.random_checkpoint import "
                        "make_random_checkpoint as m; m(sys.argv[1], sys.argv[2], dtype=sys.argv[3])",
                        str(ckpt), args.shape, dtype], check=True)
        print(f"made {ckpt} in {time.perf_counter() - t0:.0f} s")
    src_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    big_name, big = largest_tensor_bytes(ckpt)
    print(f"checkpoint {args.shape} {args.dtype}: {src_bytes / 2**30:.2f} GiB; largest tensor {big_name} "
          f"{big / 2**20:.0f} MiB; {os.cpu_count()} CPUs")
    results = []
    for tp in args.tp:
        r = run_compile(ckpt, args.work / f"art-{args.shape}-tp{tp}", tp, args.dtype)
        results.append(r)
        sizes = list(r["rank_files"].values())
        print(f"tp={tp}: {r['wall_s']:7.1f} s wall, {r['cpu_s']:7.1f} s cpu, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
              f"rank files {min(sizes) / 2**30:.3f}-{max(sizes) / 2**30:.3f} GiB each, "
              f"{sum(sizes) / 2**30:.2f} GiB total")
    base = next((r for r in results if r["tp"] == 1), None)
    verdicts = {}
    if base:
        for r in results:
            if r["tp"] > 1:
                ok = r["peak_rss_bytes"] <= base["peak_rss_bytes"] + big
                verdicts[r["tp"]] = ok
                print(f"tp={r['tp']} peak RSS - tp=1 peak RSS = {(r['peak_rss_bytes'] - base['peak_rss_bytes']) / 2**20:+.0f} MiB "
                      f"(bound: +{big / 2**20:.0f} MiB, one tensor): {'OK' if ok else 'EXCEEDED'}")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "dtype": args.dtype, "source_bytes": src_bytes,
                                         "largest_tensor": [big_name, big], "results": results,
                                         "within_one_tensor": verdicts}, indent=1) + "\n")
    if not all(verdicts.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
