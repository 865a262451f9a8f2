"""Weight offload on a GPU: decode tokens/s with most layers streamed from host memory (or the
rank file) against the PCIe bound and against the resident engine, in the same run.

    python scripts/bench_offload.py all [--shape llama-8b] [--gpu-memory 6] [--work build/offload]
    python scripts/bench_offload.py run --artifact ART --mode cpu --gpu-memory 6 --batches 1,64   # one engine

`all`: a random checkpoint of the shape, compiled in a child that sees no GPU; the host-to-device
bandwidth of pinned memory (a 1 GiB copy, best of 10); then each engine in its own process
(resident; `--offload cpu`; `--offload disk` at the middle batch): for each batch B, B prompts of
64 tokens are prefilled, then 8 steps of pure decode are timed (tokens/s = 8 B / seconds). The
PCIe bound of a step is the bytes it streams over the measured bandwidth; each offloaded number
is printed as a fraction of its bound and of the resident engine's. The greedy tokens of the
first prompt must be equal on every path. Writes $OUT/bench_offload.json (or --work's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
PROMPT, STEPS = 64, 8


def prepare(work: Path, shape: str, dtype: str) -> tuple[Path, float]:
    from bench_cold_start import compile_artifact  # (this folder is on sys.path: scripts run as files)

    return compile_artifact(work, shape, dtype, gpu_checkpoint=True, options=("--max-batch", "64", "--max-seq", "1024"))


def bandwidth() -> float:
    """Pinned host -> device GB/s, best of 10 copies of 1 GiB."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, (1 << 30) / (time.perf_counter() - t) / 1e9)
    return best


def run(art: Path, mode: str, gpu_memory: float | None, batches: list[int], device: str) -> dict:
    import torch

    from dsc.runtime.llm import LLMEngine, SamplingParams

    kw = {} if mode == "resident" else {"offload": mode, "gpu_memory": gpu_memory}
    t = time.perf_counter()
    eng = LLMEngine(art, device=device, max_num_seqs=max(batches), **kw)
    res = {
        "mode": mode,
        "load_s": round(time.perf_counter() - t, 2),
        "offload": eng.engine.offload,
        "load_times": {k: round(v, 2) for k, v in eng.load_times.items()},
        "batches": {},
    }
    vocab = eng.vocab_size
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(b)]
        params = SamplingParams(max_tokens=STEPS + 4, temperature=0.0, ignore_eos=True)
        ids = [f"{b}-{i}" for i in range(b)]
        for rid, p in zip(ids, prompts):
            eng.add_request(rid, p, params)
        got = {rid: [] for rid in ids}

        def step():
            for out in eng.step():
                got[out.request_id] = list(out.outputs[0].token_ids)

        while min(len(v) for v in got.values()) < 2:  # every prompt prefilled, two tokens out
            step()
        ring = eng.engine.ring
        moved = ring.bytes_moved if ring is not None else 0
        torch.cuda.synchronize() if device == "cuda" else None
        t = time.perf_counter()
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize() if device == "cuda" else None
        dt = time.perf_counter() - t
        moved = (ring.bytes_moved - moved) // STEPS if ring is not None else 0
        while eng.has_unfinished_requests():
            step()
        res["batches"][str(b)] = {
            "step_ms": round(dt / STEPS * 1e3, 2),
            "tokens_per_s": round(b * STEPS / dt, 1),
            "bytes_moved_per_step": moved,
            "first_tokens": got[ids[0]],
        }
        print(mode, b, res["batches"][str(b)], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["all", "run"])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--work", default="build/offload")
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--mode", default="cpu", choices=["resident", "cpu", "disk"])
    ap.add_argument("--gpu-memory", type=float, help="GiB of weights on the device (all: 6; run: every layer streamed)")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, help="run: write the result here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.what == "run":
        res = run(args.artifact, args.mode, args.gpu_memory, batches, args.device)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return
    args.gpu_memory = args.gpu_memory or 6.0
    work = Path(args.work) / args.shape
    work.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ.get("OUT") or work)
    out.mkdir(parents=True, exist_ok=True)
    art, compile_s = (args.artifact, 0.0) if args.artifact else prepare(work, args.shape, args.dtype)
    res = {
        "shape": args.shape,
        "dtype": args.dtype,
        "gpu_memory_gib": args.gpu_memory,
        "compile_s_without_gpu": round(compile_s, 1),
        "h2d_gb_s": round(bandwidth(), 2),
        "engines": {},
    }
    save = lambda: (out / "bench_offload.json").write_text(json.dumps(res, indent=1))  # noqa: E731
    middle = batches[len(batches) // 2]
    for mode, bs in (("resident", batches), ("cpu", batches), ("disk", [middle])):
        path = work / f"{mode}.json"
        subprocess.run(
            [
                PY,
                __file__,
                "run",
                "--artifact",
                str(art),
                "--mode",
                mode,
                "--gpu-memory",
                str(args.gpu_memory),
                "--batches",
                ",".join(map(str, bs)),
                "--device",
                args.device,
                "--json",
                str(path),
            ],
            check=True,
        )
        res["engines"][mode] = json.loads(path.read_text())
        save()
    resident = res["engines"]["resident"]["batches"]
    for mode in ("cpu", "disk"):
        eng = res["engines"][mode]
        per_step = eng["offload"]["bytes_per_step"]
        for b, r in eng["batches"].items():
            bound_s = per_step / (res["h2d_gb_s"] * 1e9)
            r["pcie_bound_tokens_per_s"] = round(int(b) / bound_s, 1)
            r["of_pcie_bound"] = round(r["tokens_per_s"] / r["pcie_bound_tokens_per_s"], 3)
            r["of_resident"] = round(r["tokens_per_s"] / resident[b]["tokens_per_s"], 4)
            r["tokens_equal_resident"] = r["first_tokens"] == resident[b]["first_tokens"]
            print(
                f"{mode} batch {b}: {r['tokens_per_s']} tokens/s, {r['of_pcie_bound']:.0%} of the PCIe bound "
                f"({r['pcie_bound_tokens_per_s']}), {r['of_resident']:.2%} of resident "
                f"({resident[b]['tokens_per_s']}); tokens equal: {r['tokens_equal_resident']}"
            )
    save()


if __name__ == "__main__":
    main()
