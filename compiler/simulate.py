"""Run a Model's programs in the compiler's process, before anything is written: every
tensor-parallel rank in lockstep, on CPU, over weights materialized from the checkpoint.

Each program is executed node by node, once per rank, with that rank's weights and KV cache;
a collective (`dsc.all_reduce`, `dsc.all_gather`) combines the ranks' inputs, as NCCL would.
The int8 pass calibrates SmoothQuant with it and the int8 report compares the quantized
program with its unquantized twin; both need the program as it will run (after sharding and
fusion), which the Hugging Face model is not.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import dsc.kernels  # noqa: F401  (registers the dsc ops the programs call)
from dsc.compiler.ir import Model

Observer = Callable[[fx.Node, int, tuple], None]  # (node, rank, its evaluated args), before the call

# collective -> f(every rank's args) -> every rank's result
COLLECTIVES: dict[Any, Callable[[list[tuple]], list[torch.Tensor]]] = {
    torch.ops.dsc.all_reduce.default: lambda per_rank: [sum(a[0] for a in per_rank)] * len(per_rank),
    torch.ops.dsc.all_gather.default:  # (x, dim, world)
        lambda per_rank: [torch.cat([a[0] for a in per_rank], per_rank[0][1])] * len(per_rank),
}


def materialize(model: Model, produce: Callable[[str, int], torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """{name: tensor} per rank, `produce(name, rank)` for every weight spec."""
    return [{name: produce(name, r) for name in sorted(model.weights)} for r in range(model.options.tp)]


class Simulator:
    """All ranks of a model's programs, executed in one process."""

    def __init__(self, model: Model, weights: list[dict[str, torch.Tensor]]):
        self.model, self.weights = model, weights
        kv = model.kv_cache
        self.caches = [{f"kv_cache.{i}.{t}": torch.zeros(kv["shape"], dtype=getattr(torch, kv["dtype"]))
                        for i in range(kv["layers"]) for t in ("k", "v")} if kv else {} for _ in weights]

    def run(self, program: str, inputs: Sequence[torch.Tensor], observe: Observer | None = None) -> Any:
        """Rank 0's output of `program` on inputs (input_ids, position_ids, cache_pos, last_idx)."""
        ranks = range(len(self.weights))
        env: list[dict[fx.Node, Any]] = [{} for _ in ranks]
        args_of = lambda n, r: fx.node.map_arg((n.args, n.kwargs), lambda a: env[r][a])  # noqa: E731
        feed = iter(inputs)
        for node in self.model.programs[program].nodes:
            if node.op == "placeholder":
                x = next(feed)
                for r in ranks:
                    env[r][node] = x
            elif node.op == "get_attr":
                for r in ranks:
                    env[r][node] = self.weights[r][node.target] if node.target in self.weights[r] \
                        else self.caches[r][node.target]
            elif node.op == "output":
                return args_of(node, 0)[0][0]
            elif node.target in COLLECTIVES:
                per_rank = [args_of(node, r)[0] for r in ranks]
                for r, y in zip(ranks, COLLECTIVES[node.target](per_rank)):
                    env[r][node] = y
            else:
                for r in ranks:
                    args, kwargs = args_of(node, r)
                    if observe is not None:
                        observe(node, r, args)
                    env[r][node] = node.target(*args, **kwargs)
        raise RuntimeError(f"program {program} has no output node")

    def reset(self) -> None:
        for c in self.caches:
            for t in c.values():
                t.zero_()

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], observe: Observer | None = None) -> torch.Tensor:
        """Right-padded batch into KV rows 0..B-1 (as Engine.prefill): logits [B, V] fp32."""
        lens = [len(p) for p in prompts]
        L = max(max(lens), 2)  # the prefill program is traced for seq >= 2
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        pos = torch.arange(L).expand(len(prompts), L).contiguous()
        zeros = torch.zeros(len(prompts), dtype=torch.long)
        return self.run("prefill", (ids, pos, zeros, torch.tensor(lens) - 1), observe).float()

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
        """tokens [B] at positions cache_pos [B] -> logits [B, V] fp32."""
        return self.run("decode", (tokens[:, None], cache_pos[:, None], cache_pos, torch.zeros_like(cache_pos))).float()

    def teacher_forced(self, prompts: Sequence[Sequence[int]], tokens: torch.Tensor | None,
                       steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the prompts' last token and of `steps - 1` decode steps that feed `tokens`
        [B, steps - 1] (None: this model's own greedy tokens). Returns (logits [B, steps, V],
        the tokens fed [B, steps - 1])."""
        self.reset()
        lens = torch.tensor([len(p) for p in prompts])
        out = [self.prefill(prompts)]
        fed = []
        for i in range(steps - 1):
            tok = out[-1].argmax(-1) if tokens is None else tokens[:, i]
            fed.append(tok)
            out.append(self.decode(tok, lens + i))
        fed_t = torch.stack(fed, 1) if fed else torch.zeros(len(prompts), 0, dtype=torch.long)
        return torch.stack(out, 1), fed_t
