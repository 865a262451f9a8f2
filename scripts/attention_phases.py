"""Where the batch-1 decode attention's time goes at a short context, on one GPU.

    python3 scripts/attention_phases.py [--q-heads 8] [--kv-heads 2] [--context 128]   # about 30 s

At Llama-8B's tp=4 shard (8 query heads, 2 kv heads of 128 per rank) the decode attention is a
fixed 4-5 us per layer (docs/closing-note.md, session 22), about 140 us of a 1.4 ms step. This
times its phases. It builds 32 layers of the chain the decode step runs around it, captured in
one CUDA graph with PDL: the qkv projection (kernels/linear.py's GEMV at the shard's shape,
[1536, 4096]), the rotary decode attention reading the rotary tables' rows (kernels/attention.py,
the shipped config, its KV cache 1024 long), o_proj's GEMV ([4096, 1024]), and measures:
- the chain per layer with the attention, and without it (o_proj reading the qkv output): the
  attention's exposed time;
- inside the attention, %globaltimer stamps of one working program (kv head 0, split 0), from a
  copy of kernels/attention.py whose decode kernel stores them (made here, from the source, at
  run time): program start, the PDL wait's return, q ready (loaded, rotated), the preloaded keys
  attended, the next kernel let launch, the new token attended (its k and v stored), the output
  stored. Mean nanoseconds between consecutive stamps over every layer of every replay.
Stamps are approximate: a stamp does not wait for a load or mma issued before it whose result
is not used before it. Writes $OUT/attention_phases.json when OUT is set.
"""
from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from checkout_modules import checkout_modules

ROOT = Path(__file__).resolve().parents[1]
STAMPS = ("start", "wait", "q", "pre_tile", "launch", "new_token", "out")


def load_kernels():
    return checkout_modules("kernels.launch", "kernels.attention", "kernels.linear")


def _sub(src: str, old: str, new: str, count: int = 1) -> str:
    assert src.count(old) >= count, f"attention.py changed: {old!r} not found"
    return src.replace(old, new, count)


def stamped_attention():
    """kernels/attention.py with stamps in `_decode_kernel` (into PART_LSE, read as int64, which a
    one-split context never writes) and `decode_attention` taking PART_LSE from `_STAMPS`."""
    src = (ROOT / "kernels" / "attention.py").read_text()
    kernel_at = src.index("@_jit_on_first_use\ndef _decode_kernel(")
    head, body = src[:kernel_at], src[kernel_at:]
    stamp = "    if split == 0:\n        _stamp(PART_LSE.to(tl.pointer_type(tl.int64)) + bh * 8 + {i})\n"
    body = _sub(body, "    kvh = bh % Hkv\n", "    kvh = bh % Hkv\n" + stamp.format(i=0))
    body = _sub(body, "    # q (and what rotates it) loads first", stamp.format(i=1) + "    # q (and what rotates it) loads first")
    body = _sub(body, "        q = _rotated(q, q_half, cos[None, :], sin[None, :])\n",
                "        q = _rotated(q, q_half, cos[None, :], sin[None, :])\n" + stamp.format(i=2))
    body = _sub(body, "    for j0 in range(lo + PRE_N, hi, BLOCK_N):\n",
                stamp.format(i=3) + "    for j0 in range(lo + PRE_N, hi, BLOCK_N):\n")
    body = _sub(body, "    if (pos < Smax) & (pos < lo + split_len):", stamp.format(i=4) + "    if (pos < Smax) & (pos < lo + split_len):")
    body = _sub(body, "    out = acc / l_i[:, None]\n    if SPLIT:\n",
                stamp.format(i=5) + "    out = acc / l_i[:, None]\n    if SPLIT:\n")
    body = _sub(body, "                    out.to(OUT.dtype.element_ty), head_ok, offs_d, HEAD_DIM, BLOCK_D)\n    else:\n",
                "                    out.to(OUT.dtype.element_ty), head_ok, offs_d, HEAD_DIM, BLOCK_D)\n"
                + "".join("    " + line + "\n" for line in stamp.format(i=6).splitlines()) + "    else:\n")
    body = _sub(body, "    part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device) if splits > 1 else out\n",
                "    part_lse = _STAMPS.pop(0)\n")
    helper = '''
_STAMPS = []


@_jit_on_first_use
def _stamp(P):
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(P, t)


'''
    folder = tempfile.mkdtemp(prefix="dsc-phases-")  # triton reads the kernels' source from the file when it
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # jits them (at first use): kept until exit
    path = Path(folder) / "attention_phases_kernels.py"
    path.write_text(head + helper + body)
    spec = importlib.util.spec_from_file_location("dsc.kernels._attention_phases", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    LAUNCH, ATT, LIN = load_kernels()
    SA = stamped_attention()
    dev, dt, D, L, smax, hidden = torch.device("cuda"), torch.bfloat16, 128, 32, 1024, 4096
    H, HKV = args.q_heads, args.kv_heads
    nq = (H + 2 * HKV) * D
    arch = LAUNCH.arch_of(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: (torch.randn(*shape, generator=g, device=dev) * 0.02).to(dt)  # noqa: E731
    layers = [dict(qkv=rnd(nq, hidden), o=rnd(hidden, H * D), kc=rnd(1, HKV, smax, D), vc=rnd(1, HKV, smax, D))
              for _ in range(L)]
    pos = torch.full((1,), args.context, dtype=torch.int64, device=dev)
    rot_pos = pos[:, None].clone()
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
    ang = torch.arange(smax, device=dev).float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    x0 = rnd(1, hidden)
    # 8 int64 per kv head, shaped as the part_lse [B, H, splits] they stand in for
    stamps = [torch.zeros(1, HKV * 8 * 2, 1, dtype=torch.float32, device=dev) for _ in range(L)]
    cfg_qkv, cfg_o = LIN.gemv_config(nq, hidden, arch), LIN.gemv_config(hidden, H * D, arch)

    def step(attend: str):
        x = x0
        if attend == "stamped":
            SA._STAMPS[:] = list(stamps)
        for p in layers:
            qkv = LIN.gemv(x, p["qkv"], None, cfg_qkv)
            if attend == "none":
                a = qkv[:, : H * D]
            else:
                q = qkv[:, : H * D].view(1, H, 1, D)
                k = qkv[:, H * D: (H + HKV) * D].view(1, HKV, 1, D)
                v = qkv[:, (H + HKV) * D:].view(1, HKV, 1, D)
                mod = SA if attend == "stamped" else ATT
                a = mod.decode_attention(q, k, v, p["kc"], p["vc"], pos, D ** -0.5, rotary=(cos, sin),
                                         rot_pos=rot_pos).view(1, H * D)
            x = LIN.gemv(a, p["o"], None, cfg_o)
        return x

    def graph(attend):
        step(attend)
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s), torch.cuda.graph(gr, stream=s):
            step(attend)
        torch.cuda.synchronize()
        return gr

    graphs = {name: graph(name) for name in ("shipped", "none", "stamped")}

    def per_layer_us(gr, n=50):
        for _ in range(3):
            gr.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            gr.replay()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) * 1000 / n / L

    rounds = {name: [] for name in graphs}
    for _ in range(5):
        for name, gr in graphs.items():
            rounds[name].append(per_layer_us(gr))
    chain = {name: statistics.median(v) for name, v in rounds.items()}
    deltas = [[] for _ in STAMPS[1:]]
    for _ in range(args.replays):
        graphs["stamped"].replay()
        torch.cuda.synchronize()
        for buf in stamps:
            t = buf.flatten().view(torch.int64)[:8].tolist()  # kv head 0
            for i in range(len(STAMPS) - 1):
                deltas[i].append(t[i + 1] - t[i])
    phases = {f"{STAMPS[i]}->{STAMPS[i + 1]}": statistics.mean(d) for i, d in enumerate(deltas)}
    granules = sorted({abs(d) % 1000 for d in deltas[1]})[:5]
    print(f"{torch.cuda.get_device_name()}: {H} query / {HKV} kv heads, context {args.context}, 32 layers in a graph")
    print("us per layer: " + ", ".join(f"{k} {v:.2f}" for k, v in chain.items())
          + f"; attention exposed {chain['shipped'] - chain['none']:.2f}, stamped {chain['stamped'] - chain['none']:.2f}")
    print("stamped program, mean ns between stamps:")
    for k, v in phases.items():
        print(f"  {k:>20} {v:8.0f}")
    print(f"  (timer granularity check: some deltas mod 1000 ns: {granules})")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "attention_phases.json").write_text(json.dumps(
            {"chain_us_per_layer": chain, "rounds": rounds, "phase_ns": phases, "heads": [H, HKV],
             "context": args.context}, indent=1))


if __name__ == "__main__":
    main()
