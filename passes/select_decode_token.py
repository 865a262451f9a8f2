"""select_decode_token: the decode program's last-token gather becomes a view.

Matches / rewrites (counted under `select_decode_token.select`), in the decode program only:
  h[arange(B), last_idx]: aten.index.Tensor(h, [aten.arange(B), last_idx]) with h [B, 1, ...],
  last_idx the program input (compiler/trace.py picks each sequence's token at last_idx)
  -> aten.select.int(h, 1, 0): h[:, 0], a view; the arange, read by nothing else, goes too.
  A decode step has one token per sequence, so 0 is the only last_idx the gather accepts, and
  the two launches (arange, gather) of every step are gone, and the lm_head GEMV follows the
  final norm's kernel directly, so with PDL it starts loading its weight while the norm runs
  (kernels/launch.py).
Requires: the traced decode program (its sequence dimension the constant 1).
Guarantees: the same values for every last_idx the gather accepted. The runtime's decode steps
  pass zeros (runtime/decode.py); `Engine.run` of the decode program rejects any other
  last_idx, as the gather did, with a clear error (the kernel no longer reads it).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dsc.compiler.ir import Model
from dsc.passes._util import aten, is_call, replace_with


def _last_token_gather(node) -> bool:
    if not is_call(node, aten.index.Tensor) or len(node.args) != 2:
        return False
    h, idx = node.args
    val = getattr(h, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.shape[1] != 1:
        return False
    if not isinstance(idx, (list, tuple)) or len(idx) != 2:
        return False
    rows, last = idx
    return (
        is_call(rows, aten.arange.default, aten.arange.start)
        and isinstance(last, fx.Node)
        and last.op == "placeholder"
        and last.name == "last_idx"
    )


def select_decode_token(model: Model) -> Model:
    graph = model.programs.get("decode")
    if graph is None:
        return model
    found = [n for n in graph.nodes if _last_token_gather(n)]
    for node in found:
        replace_with(node, aten.select.int, (node.args[0], 1, 0))
        model.counters["select_decode_token.select"] += 1
    if found:
        graph.eliminate_dead_code()  # the arange and the batch size it read
    return model
