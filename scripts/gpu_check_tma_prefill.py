"""GPU check of the prefill attention's TMA path through the runtime (run on a CUDA machine).

A random Llama with Llama-8B's attention (head_dim 128, 4 query heads per kv head; fewer and
narrower layers, so it compiles in seconds) is compiled in bf16, then run on the GPU twice in
one process: with the sm_90 table's prefill row (TMA: K/V tiles through tensor descriptors,
q/k/v as the runtime passes them, strided views of the fused projection) and with the same row
without TMA (per-thread pointer loads). Prefill runs eagerly, so switching the table row in
between changes the kernel. Checked: prefill logits of a right-padded batch (prompts of 700, 300
and 1 tokens), a chunked prefill (a second prompt chunk on top of the cached first) and greedy
tokens; the two paths do the same arithmetic in the same order, so they should agree to the last
bit or nearly (reported: max abs difference of the logits, and whether the tokens are equal).

    python scripts/gpu_check_tma_prefill.py        # exit 1 if the paths disagree; $OUT/gpu_check_tma_prefill.json
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def chunk(e, parts, start):
    """Prefill `parts` at cache positions `start` (a chunked prefill: the runtime's prefill
    program with cache_pos > 0); the last token's logits."""
    L = max(max(map(len, parts)), 2)
    ids = torch.zeros(len(parts), L, dtype=torch.long)
    for i, p in enumerate(parts):
        ids[i, : len(p)] = torch.tensor(p)
    cache_pos = torch.tensor(start)
    pos = cache_pos[:, None] + torch.arange(L)[None, :]
    last = torch.tensor([len(p) - 1 for p in parts])
    return e.run("prefill", *(t.to(e.device) for t in (ids, pos, cache_pos, last)))


def run(art, prompts, new_tokens):
    import dsc

    e = dsc.load(art, device="cuda" if torch.cuda.is_available() else "cpu")
    logits = e.prefill(prompts).float().cpu()
    e.reset()
    long = [p for p in prompts if len(p) > 1]
    e.prefill([p[: len(p) // 2] for p in long])  # first chunks, then the rest on top of them
    chunked = chunk(e, [p[len(p) // 2:] for p in long], [len(p) // 2 for p in long])
    tokens = e.generate(prompts, max_new_tokens=new_tokens, stop_tokens=[]).tokens
    return logits, chunked.float().cpu(), tokens


def main() -> int:
    import dsc
    from dsc.compiler.random_checkpoint import make_random_checkpoint
    from dsc.kernels import attention as A

    smoke = "--smoke" in sys.argv  # CPU: the script's own code path, tiny model
    work = Path(tempfile.mkdtemp(prefix="dsc-tma-"))
    t = time.perf_counter()
    layers = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=64, intermediate_size=512) if smoke else \
        dict(num_hidden_layers=4, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
             intermediate_size=4096)
    ckpt = make_random_checkpoint(work / "ckpt", "llama-1b", dtype="bfloat16",
                                  device="cuda" if torch.cuda.is_available() else "cpu", **layers)
    art = work / "art"
    dsc.compile(str(ckpt), art, max_batch=4, max_seq=64 if smoke else 2048)
    print(f"checkpoint + compile {time.perf_counter() - t:.1f}s ({layers})", flush=True)
    g = torch.Generator().manual_seed(0)
    lens = (20, 9, 1) if smoke else (700, 300, 1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lens]

    key = ("sm_90", 128)
    row = dict(A.PREFILL_CONFIGS[key])
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "table_row": row,
              "model": layers, "prompt_lengths": list(lens)}
    made = []  # the TMA path ran: descriptors were made (None: a tensor TMA cannot address)
    descriptors = A._kv_descriptors
    A._kv_descriptors = lambda *a, **k: made.append(descriptors(*a, **k)) or made[-1]
    try:
        tma = run(art, prompts, 8)
    finally:
        A._kv_descriptors = descriptors
    report["tma_calls"] = sum(d is not None for d in made)
    report["tma_fell_back"] = sum(d is None for d in made)
    A.PREFILL_CONFIGS[key] = {k: v for k, v in row.items() if k != "TMA"}
    try:
        plain = run(art, prompts, 8)
    finally:
        A.PREFILL_CONFIGS[key] = row
    for name, a, b in (("prefill", tma[0], plain[0]), ("chunked_prefill", tma[1], plain[1])):
        report[f"{name}_max_abs_diff"] = float((a - b).abs().max())
        report[f"{name}_max_abs"] = float(b.abs().max())
    report["tokens_equal"] = tma[2] == plain[2]
    ok = report["tokens_equal"] and (report["tma_calls"] > 0 or smoke) and all(report[f"{n}_max_abs_diff"] <= 1e-2 * max(1.0, report[f"{n}_max_abs"])
                                        for n in ("prefill", "chunked_prefill"))
    report["ok"] = ok
    print(json.dumps(report, indent=1))
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check_tma_prefill.json").write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
