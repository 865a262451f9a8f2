"""bind_kv_cache: give every attention its layer's KV cache.

Matches  dsc.causal_attention(q, k, v, cache_pos, scale[, window[, softcap[, alibi_slopes]]])
         (the static programs')
Rewrites dsc.attention(q, k, v, kv_cache.<i>.k, kv_cache.<i>.v, cache_pos, scale[, ...])
Matches  dsc.ragged_attention(q, k, v, slot_mapping, query_start, query_lens, cache_lens,
                              block_tables, scale[, window[, softcap[, alibi_slopes]]])
         (the ragged program's)
Rewrites dsc.paged_attention(q, k, v, kv_pool.<i>.k, kv_pool.<i>.v, slot_mapping, ...),
         i = the attention's index in program order (the same in every program); the trailing
         arguments (a sliding window, soft-capping, ALiBi slopes), where set, are carried over.
Requires: canonicalize ran. Guarantees: model.kv_cache describes the static programs' cache
         {layers, shape [max_batch, kv_heads, max_seq, head_dim], dtype}; model.kv_pool the
         ragged program's block pool {layers, block_size, kv_heads, head_dim, dtype}, whose
         number of blocks the runtime chooses at load (from a memory budget). The runtime
         allocates those tensors once and every program reads and writes them in place.
"""

from __future__ import annotations

import torch

from dsc.compiler.ir import Model
from dsc.passes._util import replace_with

_BOUND = {
    torch.ops.dsc.causal_attention.default: ("kv_cache", torch.ops.dsc.attention.default),
    torch.ops.dsc.ragged_attention.default: ("kv_pool", torch.ops.dsc.paged_attention.default),
}


def bind_kv_cache(model: Model) -> Model:
    opts = model.options
    layouts = {}
    for _, graph in model.graphs():
        for traced, (kind, bound) in _BOUND.items():
            attn = [n for n in graph.nodes if n.target is traced]
            for i, node in enumerate(attn):
                q, k, v, *rest = node.args
                kv = k.meta["val"]  # [B, Hkv, S, D]
                dtype = str(kv.dtype).removeprefix("torch.")
                if kind == "kv_cache":
                    shape = (opts.max_batch, kv.shape[1], opts.max_seq, kv.shape[3])
                    layouts[kind] = {"layers": len(attn), "shape": list(shape), "dtype": dtype}
                else:  # the plan's pool holds the blocks of max_batch full sequences; the runtime sizes its own
                    shape = (
                        opts.max_batch * -(-opts.max_seq // opts.block_size),
                        kv.shape[1],
                        opts.block_size,
                        kv.shape[3],
                    )
                    layouts[kind] = {
                        "layers": len(attn),
                        "block_size": opts.block_size,
                        "kv_heads": kv.shape[1],
                        "head_dim": kv.shape[3],
                        "dtype": dtype,
                    }
                with graph.inserting_before(node):
                    kc = graph.get_attr(f"{kind}.{i}.k")
                    vc = graph.get_attr(f"{kind}.{i}.v")
                for c in (kc, vc):
                    with torch._guards.detect_fake_mode([kv]) or model.fake_mode:
                        c.meta["val"] = torch.empty(shape, dtype=kv.dtype)
                replace_with(node, bound, (q, k, v, kc, vc, *rest))
                model.counters[f"bind_kv_cache.{'attention' if kind == 'kv_cache' else 'paged_attention'}"] += 1
    model.kv_cache = layouts.get("kv_cache")
    model.kv_pool = layouts.get("kv_pool")
    return model
