"""bind_kv_cache: give every attention its layer's KV cache.

Matches  dsc.causal_attention(q, k, v, cache_pos, scale[, window])  (what tracing records)
Rewrites dsc.attention(q, k, v, kv_cache.<i>.k, kv_cache.<i>.v, cache_pos, scale[, window]),
         i = the attention's index in program order (the same in every program); a sliding
         window, where the layer has one, is carried over.
Requires: canonicalize ran. Guarantees: model.kv_cache describes the cache layout
         {layers, shape [max_batch, kv_heads, max_seq, head_dim], dtype, tensors}; the runtime
         allocates those tensors once and every program reads and writes them in place.
"""
from __future__ import annotations

import torch

from dsc.compiler.ir import Model
from dsc.passes._util import replace_with


def bind_kv_cache(model: Model) -> Model:
    opts = model.options
    layout = None
    for _, graph in model.graphs():
        attn = [n for n in graph.nodes if n.target is torch.ops.dsc.causal_attention.default]
        for i, node in enumerate(attn):
            q, k, v, cache_pos, scale, *window = node.args
            kv = k.meta["val"]  # [B, Hkv, S, D]
            shape = (opts.max_batch, kv.shape[1], opts.max_seq, kv.shape[3])
            layout = {"layers": len(attn), "shape": list(shape),
                      "dtype": str(kv.dtype).removeprefix("torch.")}
            with graph.inserting_before(node):
                kc = graph.get_attr(f"kv_cache.{i}.k")
                vc = graph.get_attr(f"kv_cache.{i}.v")
            for c in (kc, vc):
                with torch._guards.detect_fake_mode([kv]) or model.fake_mode:
                    c.meta["val"] = torch.empty(shape, dtype=kv.dtype)
            replace_with(node, torch.ops.dsc.attention.default, (q, k, v, kc, vc, cache_pos, scale, *window))
            model.counters["bind_kv_cache.attention"] += 1
    model.kv_cache = layout
    return model
