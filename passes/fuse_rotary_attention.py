"""fuse_rotary_attention: a decode step's rotary embedding moves into its attention kernel.

Matches / rewrites (counted under `fuse_rotary_attention.decode`), in the decode program only:
  q', k' = dsc.rotary(q, k, cos, sin)                 (its outputs read through getitem 0 / 1)
  out = dsc.attention(q', k', v, k_cache, v_cache, cache_pos, scale[, window[, softcap[, alibi_slopes]]]),
  q' and k' read by nothing else
  -> out = dsc.rotary_attention(q, k, v, cos, sin, k_cache, v_cache, cache_pos, scale[, window, rot_pos
  [, softcap[, alibi_slopes]]]): the variant's arguments follow rot_pos, where they are set
  On CUDA the decode attention kernel rotates the group's query rows as it loads them and the
  new token's key before it writes it to the cache: one launch fewer per layer. Measured alone
  on an H200 (`scripts/bench_kernels.py fused-decode`, CUDA graphs of back-to-back calls, batch 1)
  the fused kernel takes what the pair took (4.8 us at context 128, 13.8 against 14.4 us at
  4096 with Llama-8B's heads): the gain is the launch in a step's chain of dependent kernels,
  not in the isolated kernel time. The prefill program keeps the pair: there the
  attention kernel reads every key many times, and the rotary kernel is one launch per layer
  over all of the prompt's tokens.
  Where cos and sin are fold_position_tables' lookups table[position_ids] of 2-D tables with the
  same positions, the op takes the tables and the positions instead (rot_pos, its last argument;
  counted under `fuse_rotary_attention.tables`): the kernel reads each sequence's row itself,
  before it waits for the qkv projection, and the step loses the two gathers' launches (once
  every layer reads the tables so, the lookups have no reader left and go).
Requires: fuse_rotary (it makes dsc.rotary); shard_tensor_parallel and fold_position_tables ran
  (the graph is the rank's, cos / sin are the table lookups), so the pass sees the final pair.
Guarantees: the pair's arithmetic (q' and k' rounded to their dtypes where dsc.rotary stores
  them, k' then to the cache's): the same values on CPU, in the interpreter and on an H200
  (output and cache bit for bit, tests/gpu/test_gpu_fused_decode.py); no other node changes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.node import Argument

from dsc.compiler.ir import Model
from dsc.passes._util import arg_int, aten, is_call, replace_with

dsc = torch.ops.dsc


def _attention_reading(rotary: fx.Node) -> fx.Node | None:
    """The dsc.attention whose q and k are `rotary`'s two outputs and that is their only reader."""
    items = [u for u in rotary.users if is_call(u, operator.getitem)]
    if len(items) != len(rotary.users) or sorted(arg_int(i, 1) for i in items) != [0, 1]:
        return None
    q, k = sorted(items, key=lambda i: arg_int(i, 1))
    readers = set(q.users) | set(k.users)
    attn = readers.pop() if len(readers) == 1 else None
    if (
        not is_call(attn, dsc.attention.default)
        or attn.kwargs
        or attn.args[0] is not q
        or attn.args[1] is not k
        or any(a is q or a is k for a in attn.args[2:])
    ):
        return None
    return attn


def _table_lookup(node: Argument) -> tuple[fx.Node, fx.Node] | None:
    """(table, positions) where node is fold_position_tables' table[positions] of a 2-D table
    [P, D] (a constant) by positions [B, S]."""
    if not is_call(node, aten.index.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    table, idx = node.args
    if not (
        isinstance(table, fx.Node)
        and table.op == "get_attr"
        and isinstance(idx, (list, tuple))
        and len(idx) == 1
        and isinstance(idx[0], fx.Node)
    ):
        return None
    t, p = table.meta.get("val"), idx[0].meta.get("val")
    if not (
        isinstance(t, torch.Tensor)
        and t.dim() == 2
        and isinstance(p, torch.Tensor)
        and p.dim() == 2
        and not p.is_floating_point()
    ):
        return None
    return table, idx[0]


def fuse_rotary_attention(model: Model) -> Model:
    graph = model.programs.get("decode")
    if graph is None:
        return model
    for rotary in [n for n in graph.nodes if is_call(n, dsc.rotary.default)]:
        attn = _attention_reading(rotary)
        if attn is None:
            continue
        q, k, cos, sin = rotary.args
        v, rest = attn.args[2], attn.args[3:]  # rest: k_cache, v_cache, cache_pos, scale[, window[, variant]]
        window, variant = rest[4:5], rest[5:]  # variant: softcap[, alibi_slopes]
        tc, ts = _table_lookup(cos), _table_lookup(sin)
        if tc and ts and tc[1] is ts[1] and tc[0].meta["val"].shape == ts[0].meta["val"].shape:
            # the output is the attention's (its value kept: the tables' fake values come from the
            # model's fake mode, not the program's, so the op is not run on them here)
            replace_with(
                attn,
                dsc.rotary_attention.default,
                (q, k, v, tc[0], ts[0], *rest[:4], *(window or (0,)), tc[1], *variant),
                infer=False,
            )
            model.counters["fuse_rotary_attention.tables"] += 1
        else:
            tail = (*rest[:4], *(window or (0,)), None, *variant) if variant else rest  # rot_pos None
            replace_with(attn, dsc.rotary_attention.default, (q, k, v, cos, sin, *tail))
        for item in list(rotary.users):
            graph.erase_node(item)
        graph.erase_node(rotary)
        for lookup in (cos, sin):  # read by no layer now
            if isinstance(lookup, fx.Node) and not lookup.users:
                graph.erase_node(lookup)
        model.counters["fuse_rotary_attention.decode"] += 1
    return model
