"""What tensor parallelism could reach if its collectives cost nothing, measured on one GPU.

    python3 scripts/tp_local_bound.py ART_TP1 ART_TP2 [ART_TP4 ...] [--iters 50] [--context 128]

Loads rank 0 of each artifact in this one process, without a process group, and replaces its
collectives with local stand-ins of no communication:
- all-reduce + add + RMSNorm (`dsc::all_reduce_add_rmsnorm`) -> the add + RMSNorm kernel alone,
  the one tp=1 runs in its place;
- the row-parallel linear + all-reduce + norm (`dsc::linear_all_reduce_add_rmsnorm`) -> the
  linear's kernel, then that add + RMSNorm (tp=1's two launches); with --push-local, where the
  GEMV push kernel would run, that kernel itself as rank 0 launches it, every peer's buffer a
  region of a local one (its programs push their rows to every "rank" and its last program
  waits for them, sums and normalizes: the real launch's tiles, registers, stores and waves,
  without the NVLink latency and the wait for slower peers); the same for --int8's
  `dsc::linear_w8a16_all_reduce_add_rmsnorm` (the W8A16 linear then the add + RMSNorm, or with
  --push-local the W8A16 GEMV push kernel at its config, `w8a16_push_config`, DSC_TUNING's
  `w8a16_gemv_push` rows included);
- the vocab-parallel embedding + all-reduce + RMSNorm (`dsc::vocab_embedding_all_reduce_rmsnorm`)
  -> the rank's lookup (`dsc::vocab_embedding`), then the RMSNorm kernel (tp=1's embedding and
  layer 0's input norm: two launches);
- the logits' all-gather (`dsc::all_gather`) -> rank 0's shard repeated (one copy kernel);
- `dsc::all_reduce` (unfused: the embedding's where fuse_add_norm left it, a model without
  RMSNorm) stays the identity it is without a group (a copy).
The results are wrong numbers computed at the shard's shapes: every kernel a tp rank runs,
with every wait for a peer and every NVLink transfer removed. Its batch-1 decode step (CUDA
graphs, the context `dsc bench` uses; PDL as DSC_PDL says: on by default, as in tp ranks
since session 17) is a lower bound on that tp's step on real GPUs,
so its ratio to tp=1 (timed here the same way, steps queued back to back) bounds what any
all-reduce could achieve. Prints a table; writes $OUT/tp_local_bound.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


_LOCAL_PUSH: dict = {}  # (device, dtype, world) -> a world's push buffers, all in one local buffer
_WORLD = [1]  # the tp of the artifact being run (step_ms sets it)


def local_push_state(device: torch.device, dtype: torch.dtype, numel: int, world: int):
    """kernels/collectives.py's `_Symmetric`, as `_launch_gemv_push` reads it, for rank 0 of
    `world` ranks whose peers' buffers are the regions of its own: "rank p's buffer" starts at
    region p of one local buffer of world x numel elements (the marker everywhere), so rank 0's
    stores for rank p land in its own region p and its last program finds every region filled by
    its own programs. Every slot the same buffer. Made on the first call (the eager warm-up before
    a graph capture) and kept; a longer row replaces it."""
    import types

    from dsc.kernels import collectives as C

    numel = -(-numel // 64) * 64  # regions 128-byte aligned (the kernel assumes 16)
    s = _LOCAL_PUSH.get((device, dtype, world))
    if s is None or s.numel < numel:
        buf = torch.empty(world * numel, dtype=dtype, device=device)
        buf.view(C._BITS[dtype]).fill_(C._MARK[dtype])
        peers = [buf.data_ptr() + p * numel * buf.element_size() for p in range(world)]
        s = types.SimpleNamespace(world=world, rank=0, numel=numel, rows=1, dtype=dtype, buffers=[buf],
                                  push_ptrs=torch.tensor([peers] * 3, dtype=torch.int64, device=device))
        _LOCAL_PUSH[(device, dtype, world)] = s
    return s


def local_push_norm(residual, x, weight, norm_weight, eps, config: dict, world: int):
    """`_gemv_push_kernel` with the all-reduce's end as rank 0 of `world` runs it (`config`: the
    GEMV push config; the same tiles, warps and registers), every peer's buffer a region of a
    local one (`local_push_state`): (s, y) of residual + world x (x @ weight.T) and its RMSNorm,
    wrong numbers of the real launch's work without the NVLink latency. One launch."""
    from dsc.kernels import collectives as C

    s = local_push_state(x.device, x.dtype, weight.shape[0], world)
    out_s, out_y = C._launch_gemv_push(s, 0, x, weight, config, (residual, norm_weight.contiguous(), eps))
    return out_s.view(residual.shape), out_y.view(residual.shape)


def local_w8a16_push_norm(residual, x, qweight, scale, zero, group_size, norm_weight, eps, config: dict,
                          world: int):
    """`local_push_norm` for the W8A16 GEMV push kernel (`_w8a16_gemv_push_kernel`, `config`:
    its GEMV config before the launch raises it): residual + world x the W8A16 linear of x, and
    its RMSNorm. One launch."""
    from dsc.kernels import collectives as C

    s = local_push_state(x.device, x.dtype, qweight.shape[0], world)
    out_s, out_y = C._launch_w8a16_push(s, 0, x, qweight, scale, zero, group_size, config,
                                        (residual, norm_weight.contiguous(), eps))
    return out_s.view(residual.shape), out_y.view(residual.shape)


def _stand_ins(device_type: str, push_local: bool = False) -> None:
    from dsc.kernels import collectives as C
    from dsc.kernels.int8 import group_k
    from dsc.kernels.launch import arch_of

    def add_norm(residual, x, weight, eps):
        return torch.ops.dsc.add_rmsnorm(x, residual, weight, eps)

    def linear_add_norm(residual, x, weight, norm_weight, eps):
        cfg = None
        if push_local and x.numel() == weight.shape[1] and x.dtype == weight.dtype == residual.dtype:
            cfg = C.gemv_push_config(*weight.shape, arch_of(x.device))
        if cfg is not None:
            return local_push_norm(residual, x, weight, norm_weight, eps, cfg, _WORLD[0])
        s, y = torch.ops.dsc.add_rmsnorm(torch.ops.dsc.linear(x, weight), residual, norm_weight, eps)
        return s.view(residual.shape), y.view(residual.shape)

    def w8a16_add_norm(residual, x, qweight, scale, zero, group_size, norm_weight, eps):
        if push_local and x.numel() == qweight.shape[1] and x.dtype == residual.dtype:
            cfg = C.w8a16_push_config(*qweight.shape, group_k(scale, group_size), arch_of(x.device), x.element_size())
            return local_w8a16_push_norm(residual, x, qweight, scale, zero, group_size, norm_weight, eps, cfg,
                                         _WORLD[0])
        y = torch.ops.dsc.linear_w8a16(x, qweight, scale, zero, None, group_size)
        s, y = torch.ops.dsc.add_rmsnorm(y, residual, norm_weight, eps)
        return s.view(residual.shape), y.view(residual.shape)

    def embedding_norm(weight, ids, start, norm_weight, eps):
        h = torch.ops.dsc.vocab_embedding(weight, ids, start)
        return h, torch.ops.dsc.rmsnorm(h, norm_weight, eps)

    C.all_reduce_add_rmsnorm.register_kernel(device_type)(add_norm)
    C.linear_all_reduce_add_rmsnorm.register_kernel(device_type)(linear_add_norm)
    C.linear_w8a16_all_reduce_add_rmsnorm.register_kernel(device_type)(w8a16_add_norm)
    C.vocab_embedding_all_reduce_rmsnorm.register_kernel(device_type)(embedding_norm)
    C.all_gather.register_kernel(device_type)(lambda x, dim, world: torch.cat([x] * world, dim))


def step_ms(path: str, iters: int, context: int, dev: torch.device, profile: bool = False) -> dict:
    from dsc.runtime.artifact import open_artifact
    from dsc.runtime.bench import _time, _time_queued, decode_bytes
    from dsc.runtime.engine import Engine

    art = open_artifact(path, ranks=[0], verify=False)
    _WORLD[0] = art.tp  # --push-local: the GEMV push kernel as a rank of this tp launches it
    engine = Engine(art, 0, art.tp, dev, cuda_graphs=dev.type == "cuda")
    g = torch.Generator().manual_seed(0)
    engine.reset()
    engine.prefill([torch.randint(0, engine.vocab_size, (context,), generator=g).tolist()])
    tok = torch.randint(0, engine.vocab_size, (1,), generator=g).to(dev)
    pos = torch.full((1,), context, dtype=torch.long, device=dev)
    s = _time(lambda: engine._decode(tok, pos), dev, iters)
    q = _time_queued(lambda: engine._decode(tok, pos), dev, *((10, 7) if dev.type == "cuda" else (2, 3)))
    nbytes = decode_bytes(engine, 1, context + 1)["total"]
    out = {"artifact": path, "tp": art.tp, "ms_per_step": s * 1e3, "ms_per_step_queued": q * 1e3, "bytes": nbytes,
           "tb_per_s": nbytes / q / 1e12, "cuda_graphs": engine._decode.captured}
    if profile:
        from dsc.runtime.profile import profile_decode, render_profile

        prof = profile_decode(engine, 1, context)
        print(f"tp={art.tp} ({path}):\n{render_profile(prof)}")
        out["profile"] = prof
    return out  # the engine goes with this frame: main() empties the cache before the next


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", help="artifacts of one model at several tp (tp=1 first)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: the script's own check (the times mean nothing)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile each artifact's step (`dsc bench --profile`'s table, with exposed times)")
    ap.add_argument("--push-local", action="store_true",
                    help="run the GEMV push kernel (ending the all-reduce) as rank 0 launches it, in place of "
                         "the row-parallel linear + norm pair (also BOUND_PUSH_LOCAL=1, so that gpu_tp.sh's "
                         "BOUND_ENVS can set it beside the default in one call)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("tp_local_bound.py: no CUDA GPU here (--device cpu runs the script's own check)")
    _stand_ins(dev.type, args.push_local or os.environ.get("BOUND_PUSH_LOCAL") == "1")
    rows = []
    for p in args.artifacts:
        rows.append(step_ms(p, args.iters, args.context, dev, args.profile))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r for r in rows if r["tp"] == 1), None)
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; batch-1 decode at context {args.context}, rank 0, collectives local")
    # queued (steps back to back, as `generate` and `dsc bench`'s queued column run them) is the
    # steadier figure and the ratio's; a step alone, synced after it, scattered by 150-250 us at
    # tp=2 across runs (session 14)
    print(f"{'tp':>3} {'ms/step':>8} {'queued':>7} {'TB/s':>6} {'x tp1':>6}  artifact")
    for r in rows:
        r["x_tp1"] = r["ms_per_step_queued"] / base["ms_per_step_queued"] if base else None
        print(f"{r['tp']:>3} {r['ms_per_step']:8.3f} {r['ms_per_step_queued']:7.3f} {r['tb_per_s']:6.2f} "
              f"{'-' if r['x_tp1'] is None else format(r['x_tp1'], '6.3f'):>6}  {r['artifact']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "tp_local_bound.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
