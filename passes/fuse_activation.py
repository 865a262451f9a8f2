"""fuse_activation: activation subgraphs -> one elementwise kernel each.

Matches / rewrites (each counted under `fuse_activation.<rule>`):
  swiglu     silu(gate) * up  (LlamaMLP; on the slices of the fused gate_up output), or
             up * silu(gate)  (Phi-3's MLP, on the chunks of its checkpoint-fused gate_up)
             -> dsc.swiglu(gate, up), reading both halves in place
  gelu_tanh  0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))  (GPT-2's gelu_new), or
             x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))  (BLOOM's bloom_gelu_forward)
             -> dsc.gelu(x, "tanh")
  gelu       aten.gelu(x, approximate=a)   -> dsc.gelu(x, a)
  bias       dsc.gelu(linear(h, W, b), a)  -> dsc.gelu(linear(h, W), a, b)  (GPT-2's c_fc; also
             a bias added after a sharded linear): one launch fewer at batch 1, where cuBLAS
             has no bias epilogue
Requires: canonicalize (fuse_projections first, so swiglu reads the fused output).
Guarantees: one launch per activation; the kernel computes in fp32 (closer to exact than
  the op-by-op 16-bit chain it replaces; equal in fp32 up to rounding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dsc.compiler.ir import Model
from dsc.passes._pattern import Pattern, insert_fused
from dsc.passes._util import aten, is_call, take_bias

dsc = torch.ops.dsc


def swiglu_pattern(gate, up):
    return F.silu(gate) * up


def swiglu_up_first_pattern(gate, up):
    # Phi3MLP: up_states * activation_fn(gate)
    return up * F.silu(gate)


def gelu_tanh_pattern(x):
    # transformers' NewGELUActivation (gelu_new)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh_bloom_pattern(x):
    # transformers' bloom_gelu_forward: the same function spelled with a rounded sqrt(2/pi)
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


_TWO = lambda dt: (torch.randn(2, 3, 8, dtype=dt), torch.randn(2, 3, 8, dtype=dt))  # noqa: E731
SWIGLU = Pattern(swiglu_pattern, _TWO)
SWIGLU_UP_FIRST = Pattern(swiglu_up_first_pattern, _TWO)
GELU_TANH = Pattern(gelu_tanh_pattern, lambda dt: (torch.randn(2, 3, 8, dtype=dt),))
GELU_TANH_BLOOM = Pattern(gelu_tanh_bloom_pattern, lambda dt: (torch.randn(2, 3, 8, dtype=dt),))


def fuse_activation(model: Model) -> Model:
    for _, graph in model.graphs():
        for pattern in (SWIGLU, SWIGLU_UP_FIRST):  # one after the other: a mul never fuses twice
            for m in pattern.matches(graph):
                g, u = m["gate"].meta["val"], m["up"].meta["val"]
                if g.shape != u.shape or g.dtype != u.dtype:
                    continue
                insert_fused(graph, dsc.swiglu.default, (m["gate"], m["up"]), [m.output])
                model.counters["fuse_activation.swiglu"] += 1
            graph.eliminate_dead_code()
        for pattern in (GELU_TANH, GELU_TANH_BLOOM):
            for m in pattern.matches(graph):
                insert_fused(graph, dsc.gelu.default, (m["x"], "tanh"), [m.output])
                model.counters["fuse_activation.gelu_tanh"] += 1
            graph.eliminate_dead_code()
        for n in [n for n in graph.nodes if is_call(n, aten.gelu.default)]:
            approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
            insert_fused(graph, dsc.gelu.default, (n.args[0], approximate), [n])
            graph.erase_node(n)
            model.counters["fuse_activation.gelu"] += 1
        graph.eliminate_dead_code()
        for n in [n for n in graph.nodes if is_call(n, dsc.gelu.default) and len(n.args) == 2]:
            taken = take_bias(n.args[0], n)
            if taken:
                n.args = (taken[0], n.args[1], taken[1])
                model.counters["fuse_activation.bias"] += 1
        graph.eliminate_dead_code()
    return model
