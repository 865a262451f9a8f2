"""Soak `dsc serve`: steady Poisson load for a long time; the server's memory must stay flat
and its KV pool empty whenever it is idle.

    python scripts/soak_serve.py build/tiny --minutes 10 --rate 8
    python scripts/soak_serve.py --shape llama-tiny --minutes 10     # compiles a random-weight model first

Starts `dsc serve ARTIFACT --port 0` in a child process, then runs windows of `--window` seconds
of load (dsc.serve.bench, the `dsc bench-serve` generator). After each window, with the server
idle, it samples the server's resident memory (/proc/PID/status) and /metrics' KV blocks in use.
Exit 1 when the resident memory of the last third of the windows exceeds that of the first
third (after the first window, which warms up) by more than --max-growth-mib, when a window has
a failed request, or when KV blocks are in use at idle. Ends the server with SIGTERM and
checks that it exits 0.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dsc.serve.bench import BenchConfig, Lengths, run


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?", help="artifact folder (default: compile --shape into a temporary folder)")
    ap.add_argument("--shape", default="llama-tiny", help="random-weight model to compile when no artifact is given")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, help="duration in seconds (overrides --minutes)")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of load between two samples")
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second")
    ap.add_argument("--prompt-len", default="8:200")
    ap.add_argument("--output-len", default="8:64")
    ap.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn from [10, VOCAB)")
    ap.add_argument("--max-growth-mib", type=float, default=64.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, help="write the samples here")
    return ap.parse_args(argv)


def _artifact(args, tmp: Path) -> Path:
    if args.artifact:
        return Path(args.artifact)
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp / "ckpt", args.shape)
    return dsc.compile(str(ckpt), tmp / "artifact", dtype="fp32")


def _start(artifact: Path, device: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsc", "serve", str(artifact), "--port", "0", "--device", device],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    m = re.search(r"on (http://\S+)/v1", line)
    if not m:
        proc.kill()
        sys.exit(f"dsc serve did not start: {line!r}")
    url = m.group(1)
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("dsc serve did not answer /health")


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def _kv_blocks_used(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return float(re.search(r"^dsc_kv_blocks_used (\S+)$", text, re.M).group(1))


def soak(args) -> int:
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    windows = max(3, round(duration / args.window))
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start(_artifact(args, Path(tmp)), args.device)
        samples, bad = [], []
        try:
            for w in range(windows):
                cfg = BenchConfig(
                    url,
                    [args.rate],
                    max(1, round(args.rate * args.window)),
                    Lengths.parse(args.prompt_len, "--prompt-len"),
                    Lengths.parse(args.output_len, "--output-len"),
                    args.vocab,
                    seed=w,
                )
                row = run(cfg)["results"][0]
                s = {
                    "window": w,
                    "rss_mib": _rss_mib(proc.pid),
                    "kv_blocks_used_idle": _kv_blocks_used(url),
                    "completed": row["completed"],
                    "failed": row["failed"],
                    "output_tokens_per_s": row["output_tokens_per_s"],
                    "e2e_p99_ms": row["e2e_ms"]["p99"],
                }
                samples.append(s)
                print(
                    f"window {w}: rss {s['rss_mib']:.1f} MiB, kv blocks at idle {s['kv_blocks_used_idle']:.0f}, "
                    f"{s['completed']} done, {s['failed']} failed, {s['output_tokens_per_s']:.1f} tok/s",
                    flush=True,
                )
                if s["failed"]:
                    bad.append(f"window {w}: {s['failed']} failed requests: {row['errors']}")
                if s["kv_blocks_used_idle"]:
                    bad.append(f"window {w}: {s['kv_blocks_used_idle']:.0f} KV blocks in use at idle")
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(60)
    if rc != 0:
        bad.append(f"the server exited {rc} on SIGTERM")
    third = max(1, (len(samples) - 1) // 3)
    first = statistics.median(s["rss_mib"] for s in samples[1 : 1 + third])
    last = statistics.median(s["rss_mib"] for s in samples[-third:])
    print(
        f"rss: first third {first:.1f} MiB, last third {last:.1f} MiB, growth {last - first:+.1f} MiB "
        f"(limit {args.max_growth_mib} MiB) over {len(samples)} windows"
    )
    if last - first > args.max_growth_mib:
        bad.append(f"resident memory grew {last - first:.1f} MiB")
    if args.json:
        args.json.write_text(
            json.dumps({"samples": samples, "growth_mib": last - first, "problems": bad}, indent=1) + "\n"
        )
    for b in bad:
        print(f"FAIL: {b}")
    print("ok" if not bad else "soak failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(soak(_args()))
