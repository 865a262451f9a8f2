"""fuse_rotary: the rotary embedding of an attention's queries and keys -> one kernel.

Matches / rewrites (counted under `fuse_rotary.<rule>`):
  rotary_qk  q' = rotary_pattern(q, cos[:, None], sin[:, None]), k' = the same on k, where q'
             and k' are the queries and keys of one dsc.attention
             -> q', k' = dsc.rotary(q, k, cos, sin)     (cos, sin: [B, S, D], rotary_emb's output)
Requires: bind_kv_cache ran (attention nodes name their q and k); full-width rotary
  (rotate_half splits D in two halves), as Llama, Mistral and Qwen2 trace.
Guarantees: one launch rotates all q and k heads of a layer; q' and k' are contiguous
  [B, H, S, D]; each product and the sum rounded to the input dtype as transformers does.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dsc.compiler.ir import Model
from dsc.passes._pattern import Pattern, insert_fused
from dsc.passes._util import arg_node, aten, is_call

dsc = torch.ops.dsc
_ATTENTION = (
    dsc.attention.default,
    dsc.causal_attention.default,
    dsc.paged_attention.default,
    dsc.ragged_attention.default,
)


def rotary_pattern(x, cos, sin):
    # transformers' apply_rotary_pos_emb, for one of q, k; cos/sin already unsqueezed
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


ROTARY = Pattern(
    rotary_pattern,
    lambda dt: (
        torch.randn(2, 3, 4, 74, dtype=dt),
        torch.randn(2, 1, 4, 74, dtype=dt),
        torch.randn(2, 1, 4, 74, dtype=dt),
    ),
    wildcards={"half": 37},
)


def _table(n: fx.Node) -> fx.Node | None:
    """c for n = c.unsqueeze(1), c a [B, S, D] table."""
    if is_call(n, aten.unsqueeze.default) and n.args[1] == 1 and arg_node(n, 0).meta["val"].dim() == 3:
        return arg_node(n, 0)
    return None


def fuse_rotary(model: Model) -> Model:
    for _, graph in model.graphs():
        by_output = {m.output: m for m in ROTARY.matches(graph)}
        for attn in [n for n in graph.nodes if n.op == "call_function" and n.target in _ATTENTION]:
            mq, mk = by_output.get(attn.args[0]), by_output.get(attn.args[1])
            if mq is None or mk is None or (mq["cos"], mq["sin"]) != (mk["cos"], mk["sin"]):
                continue
            cos, sin = _table(mq["cos"]), _table(mq["sin"])
            D = mq["x"].meta["val"].shape[-1]
            if cos is None or sin is None or mq["half"] * 2 != D or mk["half"] * 2 != D:
                continue
            insert_fused(graph, dsc.rotary.default, (mq["x"], mk["x"], cos, sin), [mq.output, mk.output])
            model.counters["fuse_rotary.rotary_qk"] += 1
        graph.eliminate_dead_code()
    return model
