"""Benchmark (not a test): compile time and peak RSS of `dsc compile` for big random checkpoints.

    python scripts/bench_compile.py                          # llama-1b and llama-8b, bf16
    python scripts/bench_compile.py --shapes llama-1b --dir /big/disk --keep

For each shape it writes a random-weight bf16 checkpoint (streamed, tensor by tensor; the 8B
shape is ~16 GB on disk), runs `python -m dsc compile CKPT -o OUT` as a child process, and
reads that child's own peak RSS from os.wait4 (ru_maxrss). Checkpoint and artifact are deleted
afterwards unless --keep. The compiler's contract: peak RSS stays a small multiple of the
largest tensor, whatever the model size (target for the 8B shape: <= 3 GB).
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9


def checkpoint_bytes(shape: str, dtype_bytes: int = 2) -> int:
    """Size on disk of a random checkpoint of this shape, from its config alone."""
    from dsc.compiler.random_checkpoint import SHAPES

    _, f = SHAPES[shape]
    h, i, v, n = f["hidden_size"], f["intermediate_size"], f["vocab_size"], f["num_hidden_layers"]
    hd = f.get("head_dim") or h // f["num_attention_heads"]
    kv = f["num_key_value_heads"] * hd
    q = f["num_attention_heads"] * hd
    layer = h * q * 2 + h * kv * 2 + 3 * h * i + 2 * h
    emb = v * h * (1 if f.get("tie_word_embeddings") else 2)
    return (n * layer + emb + h) * dtype_bytes


def run_measured(cmd: list[str]) -> tuple[int, float, int]:
    """Run cmd as a child; return (exit code, wall seconds, peak RSS bytes of that child)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024  # Linux: KiB


def largest_tensor(ckpt: Path) -> tuple[str, int]:
    from dsc.compiler.source import open_checkpoint

    c = open_checkpoint(str(ckpt))
    name = max(c.tensors, key=lambda k: math.prod(c.tensors[k].shape))
    return name, math.prod(c.tensors[name].shape) * 2  # bf16


def bench(shape: str, workdir: Path, keep: bool) -> dict:
    need = 2 * checkpoint_bytes(shape) + 2 * 2**30  # checkpoint + artifact + slack
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(f"{workdir}: {free / GB:.1f} GB free, {shape} needs {need / GB:.1f} GB; use --dir")
    ckpt, out = workdir / f"ckpt-{shape}", workdir / f"art-{shape}"
    try:
        t0 = time.perf_counter()
        gen = [sys.executable, "-c", "import sys; from dsc.compiler.random_checkpoint import make_random_checkpoint;"
               "make_random_checkpoint(sys.argv[1], sys.argv[2], dtype='bfloat16')", str(ckpt), shape]
        subprocess.run(gen, check=True)
        print(f"{shape}: checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
        rc, secs, rss = run_measured([sys.executable, "-m", "dsc", "compile", str(ckpt), "-o", str(out),
                                      "--dtype", "bf16"])
        if rc:
            raise SystemExit(f"{shape}: dsc compile exited with {rc}")
        name, big = largest_tensor(ckpt)
        return {"shape": shape, "params_gb": checkpoint_bytes(shape) / GB, "seconds": secs, "rss": rss,
                "largest": name, "largest_bytes": big}
    finally:
        if not keep:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and artifacts")
    args = ap.parse_args()
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="dsc-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [bench(s, workdir, args.keep) for s in args.shapes]
    if not args.dir and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{'shape':<10} {'ckpt GB':>8} {'compile s':>10} {'peak RSS GB':>12} "
          f"{'largest tensor':>36} {'GB':>6} {'RSS/largest':>12}")
    for r in rows:
        print(f"{r['shape']:<10} {r['params_gb']:>8.2f} {r['seconds']:>10.1f} {r['rss'] / GB:>12.2f} "
              f"{r['largest']:>36} {r['largest_bytes'] / GB:>6.2f} {r['rss'] / r['largest_bytes']:>12.1f}")


if __name__ == "__main__":
    main()
