"""GPU check section `pdl`: programmatic dependent launch (PDL, kernels/launch.py) on a GPU: the decode-path kernels
give
the same bits with and without it, eagerly and replayed from CUDA graphs, and what it saves in
chains of ~60 kernels captured in one graph, as a decode step is.

    pytest tests/gpu/test_gpu_pdl.py                                 # H200: 1-2 minutes
    TRITON_INTERPRET=1 python tests/gpu/test_gpu_pdl.py --smoke        # this file's code on CPU, tiny shapes

Chains, at Llama-3-8B shapes (hidden 4096, intermediate 14336, 32 query / 8 kv heads of 128,
bf16), batch 1 and 8, with 16-bit linears (the Triton GEMV at batch 1, cuBLAS at batch 8) or
int8 W8A16 linears (the W8A16 GEMV at batch 1, the W8A16 tensor-core kernel at batch 8):
  layers  7 decode layers of 9 ops: add_rmsnorm, qkv linear, rotary, decode attention (writes
          the KV cache), o linear, add_rmsnorm, gate_up linear, swiglu, down linear
  reuse   10 rounds of 6 ops on [B, 4096]: a square linear, rmsnorm, gelu, swiglu, rotary,
          decode attention; each op's output is allocated where its predecessor's input was
          (the caching allocator hands back the block just freed; counted as `reused`), so a
          kernel that stored before its griddepcontrol.wait would overwrite what the previous
          kernel is still reading
Correctness, per chain: DSC_PDL=off run eagerly is the reference; DSC_PDL=auto eagerly, and CUDA
graphs captured under each setting (each replayed 3 times), must give the same bits: the
chain's outputs and every KV-cache slot its attention kernels wrote.
Timing: replays of the two graphs of each chain, alternately (5 rounds of 20 replays; medians):
microseconds per chain and per op, PDL on / off.
Writes $OUT/gpu_pdl.json when OUT is set.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from gpu_util import ROOT, cpu_smoke, run_smoke, write_summary
from timing import replay_us

from dsc import switches as SWITCHES
from dsc.kernels import (
    activation as ACT,
)
from dsc.kernels import (
    attention as ATT,
)
from dsc.kernels import (
    int8 as INT8,
)
from dsc.kernels import (
    launch as LAUNCH,
)
from dsc.kernels import (
    linear as LIN,
)
from dsc.kernels import (
    norm as NORM,
)
from dsc.kernels import (
    rotary as ROT,
)

SMOKE = __name__ == "__main__" and "--smoke" in sys.argv
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong

E, I, H, HKV, D = (64, 96, 4, 2, 16) if SMOKE else (4096, 14336, 32, 8, 128)  # H * D == E
SMAX, CONTEXT = (64, 40) if SMOKE else (2048, 1000)  # KV cache length, tokens already in it
LAYERS, ROUNDS = (2, 2) if SMOKE else (7, 10)
BATCHES = (1, 8)
EPS = 1e-5


# -- the ops of the chains ------------------------------------------------------------------------
def linear(x, w):
    """x [B, K] -> [B, N]. w [N, K] 16-bit: the Triton GEMV at one row (its tuned config, or the
    default one), cuBLAS at more; w a quantize_weight dict: the W8A16 kernels (by M)."""
    if isinstance(w, dict):
        return INT8.w8a16_matmul(x, w["qweight"], w["scale"], None, None, x.shape[-1])
    if x.shape[0] == 1:
        n, k = w.shape
        return LIN.gemv(x, w, None, LIN.gemv_config(n, k, LAUNCH.arch_of(x.device), mode="all"))
    return F.linear(x, w)


def decode_layer(x, r, p, st):
    """One Llama decode layer, 9 ops: x, r [B, E] -> (x, r) of the next layer."""
    B = x.shape[0]
    s, h = NORM.add_norm_triton("rms", x, r, p["ln1"], None, EPS)
    qkv = linear(h, p["qkv"])  # [B, (H + 2 HKV) D]
    q = qkv[:, : H * D].view(B, 1, H, D).transpose(1, 2)  # [B, H, 1, D], strided views
    k = qkv[:, H * D : (H + HKV) * D].view(B, 1, HKV, D).transpose(1, 2)
    v = qkv[:, (H + HKV) * D :].view(B, 1, HKV, D).transpose(1, 2)
    q, k = ROT.rotary_triton(q, k, st["cos"], st["sin"])
    a = ATT.decode_attention(q, k, v, p["k_cache"], p["v_cache"], st["pos"], D**-0.5)  # [B, 1, H, D]
    s2, h2 = NORM.add_norm_triton("rms", linear(a.view(B, E), p["o"]), s, p["ln2"], None, EPS)
    gu = linear(h2, p["gate_up"])  # [B, 2I]
    return linear(ACT.swiglu_triton(gu[:, :I], gu[:, I:]), p["down"]), s2


# the reuse chain's ops: fn(t [B, E], round's params, state) -> [B, E], a new tensor
REUSE_OPS = (
    ("linear", lambda t, p, st: linear(t, p["w"])),
    ("rmsnorm", lambda t, p, st: NORM.add_norm_triton("rms", t, None, p["ln"], None, EPS)[1]),
    ("gelu", lambda t, p, st: ACT.gelu_triton(t, "tanh")),
    ("swiglu", lambda t, p, st: ACT.swiglu_triton(t, st["up"])),
    ("rotary", lambda t, p, st: ROT.rotary_triton(t.view(-1, H, 1, D), st["k"], st["cos"], st["sin"])[0].view(-1, E)),
    (
        "attention",
        lambda t, p, st: ATT.decode_attention(
            t.view(-1, H, 1, D), st["k"], st["v"], p["k_cache"], p["v_cache"], st["pos"], D**-0.5
        ).view(-1, E),
    ),
)


def reuse_chain(x, params, st, reused: list[int]):
    """ROUNDS x REUSE_OPS on x [B, E]. reused[0] counts the ops whose output is the block their
    predecessor read (freed when `x` was rebound), reused[1] the ops after the first."""
    prev_in = None
    for p in params:
        for _, op in REUSE_OPS:
            cur_in = x.data_ptr()
            x = op(x, p, st)
            if prev_in is not None:
                reused[0] += x.data_ptr() == prev_in
                reused[1] += 1
            prev_in = cur_in
    return [x]


# -- inputs ---------------------------------------------------------------------------------------
def rand(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(DTYPE)


def matrix(g, n, k):
    return rand(g, n, k, scale=1 / math.sqrt(k))


def make_weights(g) -> dict:
    """16-bit weights of the layers and reuse chains, and their W8A16 quantizations."""
    norm_w = lambda: (1 + 0.1 * torch.randn(E, generator=g, device=DEVICE)).to(DTYPE)  # noqa: E731
    layers = [
        {
            "ln1": norm_w(),
            "ln2": norm_w(),
            "qkv": matrix(g, (H + 2 * HKV) * D, E),
            "o": matrix(g, E, E),
            "gate_up": matrix(g, 2 * I, E),
            "down": matrix(g, E, I),
        }
        for _ in range(LAYERS)
    ]
    rounds = [{"ln": norm_w(), "w": matrix(g, E, E)} for _ in range(ROUNDS)]
    q = lambda p: {k: INT8.quantize_weight(v) if v.dim() == 2 else v for k, v in p.items()}  # noqa: E731
    return {"bf16": (layers, rounds), "int8": ([q(p) for p in layers], [q(p) for p in rounds])}


def make_state(g, batch: int) -> dict:
    """A decode step's other inputs at `batch`: positions, rotary tables, the fixed k / v / up
    operands of the reuse chain."""
    pos = CONTEXT + (37 * torch.arange(batch, device=DEVICE)) % (SMAX - CONTEXT - 1)  # [B] int64
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    ang = torch.cat([pos[:, None].float() * inv] * 2, -1)[:, None, :]  # [B, 1, D]
    return {
        "pos": pos,
        "cos": ang.cos().to(DTYPE),
        "sin": ang.sin().to(DTYPE),
        "up": rand(g, batch, E),
        "k": rand(g, batch, HKV, 1, D),
        "v": rand(g, batch, HKV, 1, D),
    }


def with_caches(g, params: list[dict], batch: int) -> list[dict]:
    """params, each with its own KV cache [B, HKV, SMAX, D] (k and v)."""
    return [{**p, "k_cache": rand(g, batch, HKV, SMAX, D), "v_cache": rand(g, batch, HKV, SMAX, D)} for p in params]


def written_slots(params: list[dict], pos: torch.Tensor) -> list[torch.Tensor]:
    """The KV-cache slots a step writes: [B, HKV, D] of k and of v per layer / round."""
    b = torch.arange(pos.numel(), device=pos.device)
    return [p[c][b, :, pos] for p in params for c in ("k_cache", "v_cache")]


# -- checks and timing ----------------------------------------------------------------------------
def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def run(chain, slots, mode: str) -> list[torch.Tensor]:
    os.environ["DSC_PDL"] = mode
    SWITCHES.reload()  # switches are read once; re-read DSC_PDL
    return [t.clone() for t in chain()] + slots()


def capture(chain, mode: str):
    os.environ["DSC_PDL"] = mode  # read at each launch: the graph keeps what capture launched
    SWITCHES.reload()  # switches are read once; re-read DSC_PDL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    return graph, outs


def check_chain(chain, slots) -> tuple[dict, dict]:
    """(correctness, graphs): eager PDL off is the reference for eager PDL on and for the graphs
    captured with PDL off and on (CUDA), each replayed 3 times."""
    ref = run(chain, slots, "off")
    ok = {"eager on == off": same_bits(run(chain, slots, "auto"), ref)}
    graphs = {}
    if DEVICE == "cuda":
        for mode in ("off", "auto"):
            graph, outs = capture(chain, mode)
            replays = []
            for _ in range(3):
                graph.replay()
                replays.append(same_bits([t.clone() for t in outs] + slots(), ref))
            ok[f"graph {mode} == eager off"] = all(replays)
            graphs["on" if mode == "auto" else "off"] = graph
    ok["finite"] = all(bool(torch.isfinite(t.float()).all()) for t in ref)
    return ok, graphs


def chains(g, weights: dict, kind: str, batch: int) -> dict:
    """name -> (chain() -> outputs, slots() -> KV-cache slots written, ops, reuse counter)."""
    st = make_state(g, batch)
    x, r = rand(g, batch, E), rand(g, batch, E)
    layer_p, round_p = (with_caches(g, p, batch) for p in weights[kind])

    def layers():
        xx, rr = x, r
        for p in layer_p:
            xx, rr = decode_layer(xx, rr, p, st)
        return [xx, rr]

    reused = [0, 0]
    return {
        "layers": (layers, lambda: written_slots(layer_p, st["pos"]), 9 * LAYERS, None),
        "reuse": (
            lambda: reuse_chain(x, round_p, st, reused),
            lambda: written_slots(round_p, st["pos"]),
            len(REUSE_OPS) * ROUNDS,
            reused,
        ),
    }


def run_section() -> dict:
    """Every chain checked (and on CUDA timed); the summary, its "failed" list included."""
    import triton

    t0, env_before = time.time(), os.environ.get("DSC_PDL")
    dev = torch.device(DEVICE)
    os.environ["DSC_PDL"] = "auto"
    SWITCHES.reload()  # switches are read once; re-read DSC_PDL
    info = {
        "device": torch.cuda.get_device_name(dev) if DEVICE == "cuda" else "cpu (Triton interpreter)",
        "capability": list(torch.cuda.get_device_capability(dev)) if DEVICE == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pdl_on_with_auto": LAUNCH.pdl_enabled(dev),
        "shapes": dict(E=E, I=I, H=H, HKV=HKV, D=D, SMAX=SMAX, CONTEXT=CONTEXT, layers=LAYERS, rounds=ROUNDS),
    }
    print(
        f"{info['device']} (capability {info['capability']}); torch {info['torch']}; triton {info['triton']}; "
        f"DSC_PDL=auto: PDL {'on' if info['pdl_on_with_auto'] else 'OFF on this device (nothing to compare)'}",
        flush=True,
    )
    g = torch.Generator(device=DEVICE).manual_seed(0)
    weights = make_weights(g)
    results, failed = [], []
    for batch in BATCHES:
        for kind in ("bf16", "int8"):
            linears = {("bf16", 1): "gemv", ("bf16", 8): "cublas", ("int8", 1): "w8a16_gemv"}.get(
                (kind, batch), "w8a16_mma"
            )
            for name, (chain, slots, ops, reused) in chains(g, weights, kind, batch).items():
                t1 = time.time()
                ok, graphs = check_chain(chain, slots)
                row = {"chain": name, "linears": linears, "batch": batch, "ops": ops, "ok": ok}
                if reused:  # summed over the 2 eager runs and 2 captures
                    row["reused"] = f"{reused[0]}/{reused[1]}" + ("" if reused[0] else " (no write-after-read tested)")
                if graphs:
                    t = replay_us(graphs)  # median of 5 x 20 replays, alternating
                    row.update(us_off=t["off"], us_on=t["on"], on_over_off=t["on"] / t["off"])
                del graphs
                results.append(row)
                bad = [k for k, v in ok.items() if not v]
                failed += [f"{name} {linears} batch {batch}: {k}" for k in bad]
                print(
                    f"{'ok  ' if not bad else 'FAIL'} {name:6s} {linears:10s} batch {batch}: {ops} ops"
                    + (f", output where the predecessor's input was: {row['reused']}" if reused else "")
                    + (f"; FAILED: {bad}" if bad else "")
                    + f"  ({time.time() - t1:.1f} s)",
                    flush=True,
                )
    if DEVICE == "cuda":
        print(
            f"\nCUDA-graph replay, us (median of 5 x 20 replays, alternating); PDL on = DSC_PDL=auto "
            f"({'on' if info['pdl_on_with_auto'] else 'OFF here'})"
        )
        print(
            f"{'chain':6s} {'linears':10s} {'batch':>5s} {'ops':>4s} {'off/chain':>10s} {'on/chain':>10s} "
            f"{'on/off':>7s} {'off/op':>7s} {'on/op':>7s} {'saved/op':>9s}"
        )
        for row in results:
            n = row["ops"]
            print(
                f"{row['chain']:6s} {row['linears']:10s} {row['batch']:5d} {n:4d} {row['us_off']:10.1f} "
                f"{row['us_on']:10.1f} {row['on_over_off']:7.3f} {row['us_off'] / n:7.2f} {row['us_on'] / n:7.2f} "
                f"{(row['us_off'] - row['us_on']) / n:9.3f}"
            )
    if env_before is None:
        os.environ.pop("DSC_PDL", None)
        SWITCHES.reload()  # switches are read once; re-read DSC_PDL
    else:
        os.environ["DSC_PDL"] = env_before
        SWITCHES.reload()  # switches are read once; re-read DSC_PDL
    elapsed = time.time() - t0
    n_ok = sum(all(row["ok"].values()) for row in results)
    print(
        f"\n{n_ok}/{len(results)} chains give the same bits with PDL on and off, eager and from graphs; {elapsed:.0f} s"
    )
    return {**info, "results": results, "failed": failed, "elapsed_s": elapsed}


@pytest.mark.gpu
def test_pdl_same_bits_on_and_off():
    res = run_section()
    write_summary("gpu_pdl", res)
    assert len(res["results"]) == 8 and not res["failed"], res["failed"]


@cpu_smoke
def test_pdl_section_smoke_in_interpreter(tmp_path):
    """This file's code in the interpreter: every chain at tiny shapes, eager only (the GPU run
    adds CUDA graphs and timings), bit-identical with DSC_PDL off and auto."""
    run_smoke(ROOT / "tests" / "gpu" / "test_gpu_pdl.py", "--smoke", env={"OUT": str(tmp_path)})
    res = json.loads((tmp_path / "gpu_pdl.json").read_text())
    assert len(res["results"]) == 8 and not res["failed"] and res["pdl_on_with_auto"] is False


if __name__ == "__main__":
    if not SMOKE or os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run as: TRITON_INTERPRET=1 python tests/gpu/test_gpu_pdl.py --smoke (on a GPU: pytest tests/gpu)")
    summary = run_section()
    write_summary("gpu_pdl", summary)
    sys.exit(1 if summary["failed"] else 0)
