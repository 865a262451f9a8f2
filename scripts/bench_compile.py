"""Benchmark (not a test): `dsc compile` of random checkpoints, per shape x {plain, --int8} x tp:
wall and CPU time, peak RSS, bytes read and written, against a cold read of the checkpoint.

    python scripts/bench_compile.py --shapes llama-1b                  # plain and --int8, tp 1 and 4
    python scripts/bench_compile.py --shapes llama-8b --ckpt-dir /work/ckpt --variants int8 --tp 4
    python scripts/bench_compile.py --shapes llama-1b llama-8b --ckpt-dir /work/ckpt --json out.json

For each shape it uses CKPT_DIR/<shape>-<dtype> (writing it first, streamed tensor by tensor, in
a child process, when missing; the 8B shape is ~16 GB), reads its files once "cold" (each file's
cached pages dropped first with posix_fadvise(POSIX_FADV_DONTNEED): this script needs no root,
so pages that another process maps stay cached) and times it, then runs
`python -m dsc compile CKPT -o OUT --tp N [--int8] --timings T` as a child per variant and tp,
after dropping the checkpoint's cached pages the same way. Per run: wall and CPU seconds, the
child's own peak RSS (os.wait4 ru_maxrss), bytes it read and wrote (/proc/<pid>/io at its exit:
rchar/wchar, all reads and writes through system calls, page cache included), the ratio of the
wall time to the cold read, the compile's stage times (--timings), and the load average at its
end (the machine may be shared: times are upper bounds then). This script never
imports torch: Linux carries the parent's peak RSS into a forked child's ru_maxrss across exec,
so a fat parent would inflate every number. Artifacts are deleted after each run (unless
--keep), checkpoints this run wrote at its end (unless --keep). Targets: peak RSS a small
multiple of the largest tensor whatever the model size, and tp=N within one tensor (the
largest) of tp=1. Exit 1 when a tp=N compile exceeds that bound.
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
    return int(
        python(
            "import sys; from dsc.compiler.random_checkpoint import SHAPES\n"
            "f = SHAPES[sys.argv[1]][1]; h, i, v, n = (f[k] for k in ('hidden_size', 'intermediate_size', "
            "'vocab_size', 'num_hidden_layers'))\n"
            "hd = f.get('head_dim') or h // f['num_attention_heads']\n"
            "kv, q = f['num_key_value_heads'] * hd, f['num_attention_heads'] * hd\n"
            "emb = v * h * (1 if f.get('tie_word_embeddings') else 2)\n"
            "print((n * (h * q * 2 + h * kv * 2 + 3 * h * i + 2 * h) + emb + h) * int(sys.argv[2]))",
            shape,
            str(dtype_bytes),
        )
    )


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


# the child: `dsc compile` run in-process, writing its own /proc/self/io to the file descriptor
# given first as it exits
_CHILD = """
import os, runpy, sys
fd = int(sys.argv[1])
sys.argv = ["dsc"] + sys.argv[2:]
try:
    runpy.run_module("dsc", run_name="__main__")
finally:
    os.write(fd, open("/proc/self/io", "rb").read())
"""


def drop_cached(paths: list[Path]) -> None:
    """Ask the kernel to drop these files' clean cached pages (no root needed; pages another
    process maps stay)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_read_s(ckpt: Path) -> float:
    """Seconds to read the checkpoint's files once, front to back, after drop_cached."""
    files = sorted(ckpt.glob("*.safetensors"))
    drop_cached(files)
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def run_compile(ckpt: Path, out: Path, tp: int, dtype: str, int8: bool = False) -> dict:
    """`dsc compile` as a child: wall and CPU seconds, its own peak RSS, bytes it read and
    wrote, its stage times, the rank files' sizes."""
    timings = out.parent / f"{out.name}.timings.json"
    args = ["compile", str(ckpt), "-o", str(out), "--tp", str(tp), "--dtype", dtype, "--timings", str(timings)]
    args += ["--int8"] if int8 else []
    drop_cached(sorted(ckpt.glob("*.safetensors")))
    rfd, wfd = os.pipe()
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(wfd), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(wfd,),
    )
    os.close(wfd)
    err = p.stderr.read().decode()
    io_text = os.read(rfd, 1 << 16).decode()
    os.close(rfd)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.stderr.close()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"dsc {' '.join(args)} failed:\n{err}")
    io = {k: int(v) for k, v in (ln.split(": ") for ln in io_text.splitlines())}
    ranks = {f.name: f.stat().st_size for f in sorted(out.glob("rank*.safetensors"))}
    stages = json.loads(timings.read_text())
    timings.unlink()
    return {
        "tp": tp,
        "int8": int8,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB
        "load_avg": [round(x, 2) for x in os.getloadavg()],  # 1, 5, 15 min, at the compile's end
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "read_bytes": io["rchar"],
        "written_bytes": io["wchar"],
        "disk_read_bytes": io["read_bytes"],
        "rank_files": ranks,
        "timings": stages,
        "command": "dsc " + " ".join(args[:-2] + (["--int8"] if int8 else [])),
    }


VARIANTS = {"plain": False, "int8": True}


def bench(
    shape: str,
    dtype: str,
    tps: list[int],
    workdir: Path,
    keep: bool,
    variants: tuple[str, ...] = ("plain",),
    ckpt_dir: Path | None = None,
) -> dict:
    ckpt = (ckpt_dir or workdir) / f"{shape}-{dtype}"
    made = not (ckpt / "config.json").exists()
    need = (made + 1) * checkpoint_bytes(shape, 4 if dtype == "fp32" else 2) + 2 * 2**30  # + one artifact + slack
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(f"error: --dir: {workdir} has {free / GB:.1f} GB free, {shape} needs {need / GB:.1f} GB")
    try:
        if made:
            t0 = time.perf_counter()
            python(
                "import sys; from dsc.compiler.random_checkpoint import make_random_checkpoint as m; "
                "m(sys.argv[1], sys.argv[2], dtype=sys.argv[3])",
                str(ckpt),
                shape,
                DTYPES[dtype],
            )
            print(f"{shape}: checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
        name, big = largest_tensor(ckpt)
        src = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        cold = cold_read_s(ckpt)
        print(f"{shape}: {src / GB:.2f} GB read cold in {cold:.1f} s ({src / cold / GB:.2f} GB/s)", flush=True)
        runs = []
        for variant in variants:
            for tp in tps:
                art = workdir / f"art-{shape}-{variant}-tp{tp}"
                try:
                    r = run_compile(ckpt, art, tp, dtype, VARIANTS[variant])
                finally:
                    if not keep:
                        shutil.rmtree(art, ignore_errors=True)
                r["variant"] = variant
                r["wall_over_cold_read"] = round(r["wall_s"] / cold, 2)
                runs.append(r)
                print(
                    f"{shape} {variant} tp={tp}: {r['wall_s']:7.1f} s wall ({r['wall_over_cold_read']:.1f}x the cold "
                    f"read), {r['cpu_s']:7.1f} s cpu, peak RSS {r['peak_rss_bytes'] / GB:.2f} GB, read "
                    f"{r['read_bytes'] / GB:.1f} GB, wrote {r['written_bytes'] / GB:.1f} GB",
                    flush=True,
                )
        within = {}
        for variant in variants:
            base = next((r for r in runs if r["variant"] == variant and r["tp"] == 1), None)
            for r in runs:
                if base and r["variant"] == variant and r["tp"] > 1:
                    within[f"{variant} tp{r['tp']}"] = r["peak_rss_bytes"] <= base["peak_rss_bytes"] + big
        return {
            "shape": shape,
            "dtype": dtype,
            "source_bytes": src,
            "cold_read_s": round(cold, 2),
            "largest": name,
            "largest_bytes": big,
            "runs": runs,
            "within_one_tensor_of_tp1": within,
        }
    finally:
        if made and not keep:
            shutil.rmtree(ckpt, ignore_errors=True)


def table(rows: list[dict]) -> str:
    """The results as a Markdown table."""
    out = [
        "| shape | ckpt GB | cold read s | variant | tp | wall s | wall / cold read | cpu s | peak RSS GB | "
        "read GB | written GB | int8 report s | load 5 min |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        for x in r["runs"]:
            report = next((s["seconds"] for s in x["timings"]["stages"] if s["name"] == "int8 report"), None)
            out.append(
                f"| {r['shape']} | {r['source_bytes'] / GB:.2f} | {r['cold_read_s']:.1f} | {x['variant']} | "
                f"{x['tp']} | {x['wall_s']:.1f} | {x['wall_over_cold_read']:.1f} | {x['cpu_s']:.1f} | "
                f"{x['peak_rss_bytes'] / GB:.2f} | {x['read_bytes'] / GB:.1f} | {x['written_bytes'] / GB:.1f} | "
                f"{'-' if report is None else f'{report:.1f}'} | {x['load_avg'][1]:.1f} |"
            )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 4], help="tensor-parallel sizes (1 first: the baseline)")
    ap.add_argument("--dir", type=Path, default=None, help="where artifacts go (default: a temp folder)")
    ap.add_argument("--ckpt-dir", type=Path, default=None, help="where checkpoints are kept (default: --dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints this run wrote and the artifacts")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="dsc-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [bench(s, args.dtype, args.tp, workdir, args.keep, tuple(args.variants), args.ckpt_dir) for s in args.shapes]
    if not args.dir and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(all(r["within_one_tensor_of_tp1"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
