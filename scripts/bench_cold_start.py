"""Cold start of `dsc serve` with an empty Triton cache: the JIT path against the artifact's
ahead-of-time kernel binaries (`dsc compile --target sm_90`), in the same run.

    python scripts/bench_cold_start.py [--shape llama-8b] [--work build/cold] [--decode]
    python scripts/bench_cold_start.py --artifact ART --device cpu --kv-cache-memory 0.05   # smoke

1. A random checkpoint of the shape is compiled with `--target sm_90` in a child process that
   sees no GPU (as on a CI box).
2. For each path (jit: no --trust-kernels; binaries: --trust-kernels; binaries_no_verify: also
   --no-verify, which leaves out the rank file's sha256), a fresh TRITON_CACHE_DIR
   and a `dsc serve` child: seconds from its start to /health answering, then to the answer of
   a first /v1/completions request (greedy, 32 tokens), and the engine's load stages (weights,
   kernels, graphs) from its log line. The answers' texts must be equal.
3. --decode: `dsc bench` decode ms/token at batches 1 and 64 on each path (each in its own process).

Writes $OUT/bench_cold_start.json (or --work's) and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PY = sys.executable


def _child_env(extra: dict) -> dict:
    return {**os.environ, **extra}


def compile_artifact(
    work: Path,
    shape: str,
    dtype: str,
    gpu_checkpoint: bool,
    options: tuple[str, ...] = ("--target", "sm_90", "--max-batch", "64", "--max-seq", "2048"),
) -> tuple[Path, float]:
    """work/art: a random checkpoint of the shape (made on the GPU with gpu_checkpoint) compiled
    with `options` in a child that sees no GPU, as on a CI box; (artifact, compile seconds)."""
    art = work / "art"
    if (art / "manifest.json").exists():
        return art, 0.0
    ck = work / "ckpt"
    if not (ck / "config.json").exists():
        code = (
            "from dsc.compiler.random_checkpoint import make_random_checkpoint\n"
            f"make_random_checkpoint({str(ck)!r}, {shape!r}, dtype={dtype!r}, "
            f"device={'cuda' if gpu_checkpoint else 'cpu'!r})\n"
        )
        subprocess.run([PY, "-c", code], check=True, env=_child_env({}))
    t = time.perf_counter()
    subprocess.run(
        [PY, "-m", "dsc", "compile", str(ck), "-o", str(art), *options],
        check=True,
        env=_child_env({"CUDA_VISIBLE_DEVICES": ""}),
    )
    return art, time.perf_counter() - t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, timeout: float = 300.0):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def cold_serve(art: Path, trust: bool, device: str, kv_gib: float, verify: bool = True, limit: float = 400.0) -> dict:
    port = _free_port()
    cache = tempfile.mkdtemp(prefix="triton-cold-")
    cmd = [
        PY,
        "-m",
        "dsc",
        "serve",
        str(art),
        "--port",
        str(port),
        "--device",
        device,
        "--kv-cache-memory",
        str(kv_gib),
    ]
    if trust:
        cmd.append("--trust-kernels")
    if not verify:
        cmd.append("--no-verify")
    log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env({"TRITON_CACHE_DIR": cache}))
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dsc serve exited {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
            if time.perf_counter() - t0 > limit:
                raise RuntimeError("dsc serve was not ready in time")
            try:
                if _get(base + "/health", 1.0) is not None:
                    break
            except OSError:
                time.sleep(0.05)
        ready = time.perf_counter() - t0
        model = _get(base + "/v1/models")["data"][0]["id"]
        body = {"model": model, "prompt": list(range(10, 138)), "max_tokens": 32, "temperature": 0.0}
        t1 = time.perf_counter()
        first = _post(base + "/v1/completions", body)
        answered = time.perf_counter() - t0
        first_request = time.perf_counter() - t1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = Path(log.name).read_text()
    m = re.search(r"loaded in [\d.]+ s[^(]*\((.*)\)", text)
    stages = {k: float(v) for k, v in (s.rsplit(" ", 1) for s in m.group(1).split(", "))} if m else {}
    jit_lines = [line for line in text.splitlines() if "compiling it with Triton" in line or "not loaded" in line]
    return {
        "ready_s": round(ready, 2),
        "first_answer_s": round(answered, 2),
        "first_request_s": round(first_request, 3),
        "load_stages_s": stages,
        "text": first["choices"][0]["text"],
        "triton_cache_files": sum(len(f) for _, _, f in os.walk(cache)),
        "notes": jit_lines[:5],
    }


def decode_ms(art: Path, trust: bool, device: str) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [
        PY,
        "-m",
        "dsc",
        "bench",
        str(art),
        "--device",
        device,
        "--batch",
        "1",
        "--batch",
        "64",
        "--prefill",
        "128",
        "--iters",
        "100",
        "--json",
        out,
    ] + (["--trust-kernels"] if trust else [])
    subprocess.run(cmd, check=True, env=_child_env({}), stdout=subprocess.DEVNULL)
    res = json.loads(Path(out).read_text())
    return {str(b): round(r["ms_per_step"], 4) for b, r in res["decode"].items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", default="build/cold")
    ap.add_argument("--decode", action="store_true", help="also dsc bench's decode ms/token on each path")
    ap.add_argument("--artifact", type=Path, help="an artifact compiled with --target already (no compile here)")
    ap.add_argument("--kv-cache-memory", type=float, default=4.0, help="GiB of KV pool each server holds")
    args = ap.parse_args()
    work = Path(args.work) / args.shape
    work.mkdir(parents=True, exist_ok=True)
    if args.artifact is not None:
        art, compile_s = args.artifact, 0.0
    else:
        art, compile_s = compile_artifact(work, args.shape, args.dtype, gpu_checkpoint=args.device == "cuda")
    manifest = json.loads((art / "manifest.json").read_text())
    res = {
        "shape": args.shape,
        "dtype": args.dtype,
        "compile_s_without_gpu": round(compile_s, 1),
        "kernel_binaries": {k: v for k, v in manifest.get("kernel_binaries", {}).items() if k != "skipped"},
        "skipped": manifest.get("kernel_binaries", {}).get("skipped"),
    }
    out = Path(os.environ.get("OUT") or work)
    out.mkdir(parents=True, exist_ok=True)
    save = lambda: (out / "bench_cold_start.json").write_text(json.dumps(res, indent=1))  # noqa: E731
    for name, trust, verify in (("jit", False, True), ("binaries", True, True), ("binaries_no_verify", True, False)):
        res[name] = cold_serve(art, trust, args.device, args.kv_cache_memory, verify)
        save()
        print(name, {k: v for k, v in res[name].items() if k != "text"}, flush=True)
    res["texts_equal"] = res["jit"]["text"] == res["binaries"]["text"] == res["binaries_no_verify"]["text"]
    weights = res["binaries"]["load_stages_s"].get("weights", 0.0)
    res["binaries_answer_minus_weights_s"] = round(res["binaries"]["first_answer_s"] - weights, 2)
    res["speedup_first_answer"] = round(res["jit"]["first_answer_s"] / res["binaries"]["first_answer_s"], 2)
    if args.decode:
        res["decode_ms"] = {}
        for name, trust in (("jit", False), ("binaries", True)):
            res["decode_ms"][name] = decode_ms(art, trust, args.device)
            save()
        res["decode_ratio"] = {
            b: round(res["decode_ms"]["binaries"][b] / res["decode_ms"]["jit"][b], 4) for b in res["decode_ms"]["jit"]
        }
    save()
    print(json.dumps({k: v for k, v in res.items() if k not in ("jit", "binaries", "binaries_no_verify")}, indent=1))
    if not res["texts_equal"]:
        sys.exit("the two paths' first answers differ")


if __name__ == "__main__":
    main()
