"""The dsc runtime: load an artifact, run its programs, generate.

No model code: programs are rebuilt from plan.json as FX GraphModules over the rank's
weights (memory-mapped on CPU) and a preallocated KV cache. Imports torch, safetensors and
dsc.kernels only; never transformers, dsc.compiler or dsc.passes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from safetensors import safe_open

import dsc.kernels  # noqa: F401  (registers the dsc ops the plan calls)
from dsc import switches
from dsc.errors import UserError
from dsc.kernels import collectives, registry
from dsc.runtime.artifact import Artifact, open_artifact
from dsc.runtime.checks import check_token_ids
from dsc.runtime.decode import DecodeRunner
from dsc.runtime.pipeline import kv_pool_layers
from dsc.runtime.plan import build_graph
from dsc.runtime.prefill import EncodeRunner, PrefillRunner
from dsc.runtime.ragged import RaggedRunner, allocate_kv_pool
from dsc.runtime.sampling import check_sampling, sample

if TYPE_CHECKING:
    from dsc.runtime.offload import WeightRing


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # generated tokens per prompt (stop token included when hit)
    finish_reasons: list[str]  # "stop" | "length"


# the all-reduces, fused with other ops or not; the collectives that take a buffer slot in
# `program_scope` (the all-reduces and the logits' all-gather; the buffers are sized by the
# all-reduces alone): both as kernels/registry.py's declarations say
ALL_REDUCE_OPS = registry.ops_with("all_reduce")
SLOT_OPS = registry.ops_with("collective_slot")


class _Stages:
    """Wall seconds between marks, by stage name (device work of a stage waited for)."""

    def __init__(self):
        import time

        self._now = time.perf_counter
        self._last = self._now()
        self.times: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = self._now()
        self.times[stage] = now - self._last
        self._last = now


def _fewest_blocks(n: int) -> int:
    """The KV blocks every stage's pool can hold (one block table serves them all)."""
    import torch.distributed as dist

    from dsc.runtime.distributed import comm_device

    t = torch.tensor([n], dtype=torch.long, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _all_reduce_nodes(program: dict) -> list[dict]:
    """The program's all-reduces, fused with a norm or not, in order."""
    return [n for n in program["nodes"] if n.get("op") in ALL_REDUCE_OPS]


def _first_shape(node: dict) -> list:
    shape = node["shape"]
    return shape[0] if shape and isinstance(shape[0], list) else shape  # a fused node: (sum, normed)


class Engine:
    kernel_binaries: dict[str, Any]  # load() sets it: what load_binaries installed (runtime/binaries.py)

    def __init__(
        self,
        artifact: Artifact,
        rank: int,
        world: int,
        device: torch.device,
        cuda_graphs: bool = True,
        prefill_buckets: bool | None = None,
        static: bool = True,
        kv_cache_memory: float | None = None,
        max_num_seqs: int | None = None,
        offload: str | None = None,
        gpu_memory: float | None = None,
        pipeline_parallel_size: int = 1,
    ):
        self.artifact = artifact
        self.plan = artifact.plan
        # rank and world count every rank that steps together (tp x pp); a stage's ranks hold
        # one rank file each, tp_rank's (runtime/pipeline.py)
        self.rank, self.world, self.device = rank, world, device
        self.tp, self.pp = artifact.tp, pipeline_parallel_size
        self.stage, self.tp_rank = rank // self.tp, rank % self.tp
        self.dtype = getattr(torch, self.plan["model"]["dtype"])
        self.max_batch = self.plan["limits"]["max_batch"]
        self.max_seq = self.plan["limits"]["max_seq"]
        self.vocab_size = self.plan["model"]["vocab_size"]
        self.eos_token_ids = list(self.plan["model"].get("eos_token_ids") or [])
        self.kind = self.plan["model"].get("kind", "decoder")  # "encoder": one `encode` program, no cache
        from dsc.runtime.decode import CAPTURE_TIMES, capture_times_since

        captured = dict(CAPTURE_TIMES)
        clock = _Stages()
        self.ring: WeightRing | None = None  # the streamed layers' buffers (runtime/offload.py), with offload
        self.offload: dict | None = None
        self.stage_programs = self._cut_stages() if self.pp > 1 else {}
        from collections import deque

        self._sends: deque = deque()  # sends in flight (their work, their tensor)
        self._stage_group = collectives.tp_group() if self.pp > 1 and self.tp > 1 else None
        static = static and self.pp == 1
        self.weights = self._load_weights(offload, gpu_memory)
        clock.mark("weights")
        if self.ring is not None or self.pp > 1:
            # eager (a stream's copies follow the host's order of layers; a stage's receives read
            # their shapes on the host), padded as graphs are
            cuda_graphs = False
            prefill_buckets = device.type == "cuda" if prefill_buckets is None else prefill_buckets
        self._all_reduces = {name: _all_reduce_nodes(p) for name, p in self.plan["programs"].items()}
        self._slots = {
            name: sum(n.get("op") in SLOT_OPS for n in p["nodes"]) for name, p in self.plan["programs"].items()
        }
        self.all_reduce = self._enable_symmetric_all_reduce()
        # the static programs (prefill + decode over a [max_batch, max_seq] cache): `dsc bench`'s
        # and the ONNX export's; static=False (the serving engine) holds no static cache
        encoder = self.kind == "encoder"
        self.kv_cache = self._allocate_kv_cache() if static and not encoder else {}
        self.kv_pool = (
            {}
            if encoder
            else allocate_kv_pool(
                self.plan,
                device,
                kv_cache_memory,
                where=self.artifact.path / "plan.json",
                serving=not static,
                layers=kv_pool_layers(self.stage_programs["ragged"]) if self.pp > 1 else None,
                agree=_fewest_blocks if self.pp > 1 else None,
            )
        )
        clock.mark("kv_cache")
        self.programs = {
            name: self._build(p, name)
            for name, p in self.plan["programs"].items()
            if static or name in ("ragged", "encode")
        }
        clock.mark("programs")
        self.max_num_seqs = max_num_seqs or self.max_batch
        if encoder:  # on CUDA the encode program replays a graph per (batch, length) bucket
            self.buckets = ()
            self._encode = EncodeRunner(
                lambda *a: self._call("encode", *a),
                self.max_seq,
                device,
                cuda_graphs,
                int(self.plan["model"].get("pad_token_id") or 0),
            )
            self.load_times = clock.times
            return
        self.buckets = tuple(self.plan["limits"].get("decode_buckets") or [self.max_batch])
        if static:
            self._decode = DecodeRunner(self._decode_program, self.buckets, device, cuda_graphs)
            self._prefill = PrefillRunner(
                lambda *a: self._call("prefill", *a), self.max_seq, device, cuda_graphs, buckets=prefill_buckets
            )
        self.ragged = RaggedRunner(
            lambda *a: self._call("ragged", *a),
            self.plan["kv_pool"],
            self.max_seq,
            self.max_num_seqs,
            device,
            cuda_graphs,
            pad=prefill_buckets,
        )
        clock.mark("kernels_and_graphs")
        # seconds by stage; "kernels" (warm-up runs: Triton JIT) and "graphs" (captures) split the
        # capture stage, and grow when the serving engine captures its mixed steps
        self.load_times = clock.times
        self.load_times.update(capture_times_since(captured))

    def _enable_symmetric_all_reduce(self) -> str:
        """On CUDA with tp > 1: the one-shot all-reduce (kernels/collectives.py) for tensors up
        to the decode program's largest all-reduce at max_batch. Returns the path taken."""
        import torch.distributed as dist

        decode = self._all_reduces.get("decode") or []
        if self.tp == 1 or not dist.is_initialized():  # no group: e.g. the ONNX export's engine
            return "none"
        if self.device.type != "cuda" or not decode or self.pp > 1:  # (a stage's group: NCCL's all-reduce)
            return dist.get_backend()  # gloo on CPU
        numel = max(math.prod(self.max_batch if isinstance(d, str) else d for d in _first_shape(n)) for n in decode)
        rows = max(numel // _first_shape(n)[-1] for n in decode)
        return collectives.enable_symmetric(self.device, self.dtype, numel, rows)

    def _call(self, program: str, *args) -> torch.Tensor:
        if program in self.stage_programs:
            return self._call_stage(program, *args)
        with collectives.program_scope(self._slots[program]):
            return self.programs[program](*args)

    def _cut_stages(self) -> dict:
        """This rank's stage of the ragged program (runtime/pipeline.py)."""
        from dsc.runtime.pipeline import check_stages, split_layers, stage_program

        check_stages(self.plan, self.pp, str(self.artifact.path))
        nodes = self.plan["programs"]["ragged"]["nodes"]
        layer_stage = split_layers(nodes, self.artifact.rank_header(self.tp_rank), self.pp)
        return {"ragged": stage_program(nodes, layer_stage, self.stage)}

    def _call_stage(self, program: str, *inputs) -> torch.Tensor:
        """This rank's stage: the values of the stage before received, its nodes run, what the
        next stages read sent on; the last stage's logits go to rank 0 (`last_stage_logits`)."""
        from dsc.runtime.pipeline import recv_tensor

        sp = self.stage_programs[program]
        got = [recv_tensor(self.rank - self.tp, self.device) for _ in sp.recv] if self.stage > 0 else []
        with collectives.program_scope(self._slots[program]):
            out = self.programs[program](*inputs, *got)
        if self.stage < self.pp - 1:
            for t in out:
                self._send(t, self.rank + self.tp)
            return inputs[0].new_empty(0)  # (the logits come from the last stage)
        if self.tp_rank == 0:
            self._send(out, 0)
        return out

    # -- pipeline messages (runtime/pipeline.py) ------------------------------------------------
    def _send(self, t: torch.Tensor, dst: int) -> None:
        """t to rank dst without waiting for it to be received (kept until it is)."""
        from dsc.runtime.pipeline import send_tensor

        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()
        self._sends.extend(send_tensor(t, dst, wait=False))

    def drain_sends(self) -> None:
        while self._sends:
            self._sends.popleft()[0].wait()

    def hand_on(self, packed: torch.Tensor) -> None:
        """A packed step (or STOP) to the ranks that run it after this one: from rank 0 to its
        stage's other ranks, from every rank to its peer in the next stage."""
        from dsc.runtime.pipeline import broadcast_in

        if self.rank == 0 and self.tp > 1:
            broadcast_in(packed, self._stage_group)
        if self.stage < self.pp - 1:
            self._send(packed, self.rank + self.tp)

    def receive_step(self) -> torch.Tensor:
        """A follower's next packed step (on the host): rank 0's broadcast on the first stage,
        else the stage before's."""
        from dsc.runtime.pipeline import broadcast_in, recv_tensor

        if self.stage == 0:
            return broadcast_in(None, self._stage_group).cpu()
        return recv_tensor(self.rank - self.tp, torch.device("cpu"))

    def last_stage_logits(self) -> torch.Tensor:
        """Rank 0: the next step's logits, from the last stage (steps arrive in launch order)."""
        from dsc.runtime.pipeline import recv_tensor

        return recv_tensor((self.pp - 1) * self.tp, self.device)

    def _decode_program(self, input_ids, position_ids, cache_pos, last_idx):
        return self._call("decode", input_ids, position_ids, cache_pos, last_idx)

    # -- loading -------------------------------------------------------------------------
    def _load_weights(self, offload: str | None, gpu_memory: float | None) -> dict[str, torch.Tensor]:
        """The rank's weights on the device (under pipeline parallelism, those its stage reads);
        with `offload`, those beyond `gpu_memory` GiB are streamed through `self.ring` instead
        (runtime/offload.py)."""
        path = self.artifact.rank_file(self.tp_rank)
        header = self.artifact.rank_header(self.tp_rank)  # checked against the plan before any read
        if self.stage_programs:
            read = set().union(*(sp.weights for sp in self.stage_programs.values()))
            header = {k: v for k, v in header.items() if k == "__metadata__" or k in read}
        names = [k for k in header if k != "__metadata__"]
        need = sum(header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in names)
        placement = None
        if offload is not None:
            from dsc.runtime.offload import data_start, plan_offload

            budget = None if gpu_memory is None else int(gpu_memory * 2**30)
            placement = plan_offload(header, data_start(path), budget, offload, path=str(path))
            names, need = list(placement.resident), placement.device_bytes
            self.offload = placement.summary()
        free = free_device_bytes(self.device)
        if free is not None and need > free:
            raise UserError(weights_do_not_fit(path, need, free, self.device))
        out = {}
        try:
            if placement is not None and placement.streamed:
                from dsc.runtime.offload import WeightRing

                self.ring = WeightRing(placement, path, self.device)
            with safe_open(path, framework="pt", device=str(self.device)) as f:
                for k in names:
                    out[k] = f.get_tensor(k)
        except torch.OutOfMemoryError:  # free memory shrank since the check (another process), or is fragmented
            out.clear()
            self.ring = None
            torch.cuda.empty_cache()  # what this load held goes back, so the free bytes reported are the device's
            raise UserError(weights_do_not_fit(path, need, free_device_bytes(self.device) or 0, self.device)) from None
        return out

    def _allocate_kv_cache(self) -> dict[str, torch.Tensor]:
        kv = self.plan.get("kv_cache")
        if not kv:
            return {}
        dtype = getattr(torch, kv["dtype"])
        try:
            return {
                f"kv_cache.{i}.{t}": torch.zeros(kv["shape"], dtype=dtype, device=self.device)
                for i in range(kv["layers"])
                for t in ("k", "v")
            }
        except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
            raise UserError(
                f"{self.artifact.path / 'plan.json'}: the KV cache ({kv['layers']} layers x 2 x "
                f"{kv['shape']} {kv['dtype']}) does not fit on {self.device}"
            ) from None

    def _build(self, program: dict, name: str) -> fx.GraphModule:
        nodes = program.get("nodes") if isinstance(program, dict) else None
        if name in self.stage_programs:
            nodes = self.stage_programs[name].nodes
        graph, targets = build_graph(nodes, self.device, where=f"{self.artifact.path / 'plan.json'}: program {name!r}")
        attrs: dict[str, object] = {}  # the weights' tensors, and the ring that streams some
        if self.ring is not None:
            from dsc.runtime.offload import stream_weights

            stream_weights(graph, self.ring, "_weight_ring")
            attrs["_weight_ring"] = self.ring
        for t in targets:
            if self.ring is not None and t in self.ring.names:
                continue
            if t in self.weights:
                attrs[t] = self.weights[t]
            elif t in self.kv_cache:
                attrs[t] = self.kv_cache[t]
            elif t in self.kv_pool:
                attrs[t] = self.kv_pool[t]
            else:
                raise UserError(f"{self.artifact.rank_file(self.tp_rank)}: missing tensor '{t}' the plan reads")
        return fx.GraphModule(attrs, graph)

    # -- running -------------------------------------------------------------------------
    def reset(self) -> None:
        for t in self.kv_cache.values():
            t.zero_()

    @torch.inference_mode()
    def run(
        self,
        program: str,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache_pos: torch.Tensor,
        last_idx: torch.Tensor,
    ) -> torch.Tensor:
        """One forward step. Shapes: input_ids/position_ids [B, S], cache_pos/last_idx [B].
        Returns logits [B, vocab] (fp32) for the token at last_idx of each sequence."""
        self._no_stages("run")
        if program not in self.programs:
            raise ValueError(f"run: no program {program!r} (the artifact has {', '.join(self.programs)})")
        if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"run: input_ids and position_ids must both be [batch, seq], got "
                f"{list(input_ids.shape)} and {list(position_ids.shape)}"
            )
        B = input_ids.shape[0]
        if cache_pos.shape != (B,) or last_idx.shape != (B,):
            raise ValueError(
                f"run: cache_pos and last_idx must be [batch] = [{B}], got "
                f"{list(cache_pos.shape)} and {list(last_idx.shape)}"
            )
        if program == "decode" and bool((last_idx != 0).any()):  # (passes/select_decode_token.py)
            raise ValueError(
                f"run: a decode step has one token per sequence, so last_idx must be 0, got {last_idx.tolist()}"
            )
        return self._call(program, input_ids, position_ids, cache_pos, last_idx).float()

    @torch.inference_mode()
    def encode(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """An encoder's last hidden states [B, S, E] (fp32) for right-padded input_ids [B, S]
        (2 <= S <= max_seq) and the real tokens of each row, lengths [B] (1..S)."""
        if self.kind != "encoder":
            raise ValueError(f"encode: {self.artifact.path} is a {self.kind}, not an encoder")
        states = self._encode(input_ids.to(self.device), lengths.to(self.device))
        return states.to(torch.float32, copy=True)  # a graph's output buffer is reused

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], graphs: bool = True) -> torch.Tensor:
        """Write the prompts into KV-cache rows 0..B-1; return the last prompt token's logits.
        On GPU a replay of the (batch, prompt-length bucket)'s CUDA graph (runtime/prefill.py);
        graphs=False runs the program eagerly at the prompts' exact length (`dsc bench`'s baseline)."""
        self._no_stages("prefill")
        lens = [len(p) for p in prompts]
        L = max(max(lens), 2)  # the prefill program is traced for seq >= 2
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        last = torch.tensor(lens) - 1
        # a copy: a replay of the same graph overwrites its static output (fp32's .float() is no copy)
        return self._prefill(ids.to(self.device), last.to(self.device), graphs=graphs).to(torch.float32, copy=True)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
        """tokens [B], cache_pos [B] (the position each token is written at) -> logits [B, V].
        Runs in the smallest decode bucket >= B (a CUDA-graph replay on GPU)."""
        self._no_stages("decode")
        return self._decode(tokens, cache_pos).to(torch.float32, copy=True)  # the graph's buffer is reused

    def _no_stages(self, what: str) -> None:
        if self.pp > 1:
            raise UserError(
                f"{what}: the static programs do not run in pipeline stages (pipeline_parallel_size="
                f"{self.pp}); generate runs the ragged program through the scheduler"
            )

    def check_batch(self, prompts: Sequence[Sequence[int]], batch_limit: bool = True) -> None:
        if not prompts:
            raise UserError("generate: no prompts given")
        if batch_limit and len(prompts) > self.max_batch:
            raise UserError(
                f"generate: batch of {len(prompts)} prompts exceeds the artifact's "
                f"max_batch={self.max_batch} (recompile with --max-batch)"
            )
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise UserError(f"generate: prompt {i} is empty")
            if len(p) >= self.max_seq:
                raise UserError(
                    f"generate: prompt {i} has {len(p)} tokens; the artifact's max_seq is "
                    f"{self.max_seq} (recompile with --max-seq)"
                )
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise UserError(
                    f"generate: prompt {i} has token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})"
                )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        callback: Callable[[int, list[int | None]], None] | None = None,
        max_num_batched_tokens: int = 2048,
    ) -> GenerateResult:
        """Generate for token-id prompts of different lengths (any number: they are scheduled
        as the KV pool allows), through the continuous-batching scheduler (runtime/scheduler.py).

        Greedy when temperature == 0, else sampled (top-k, top-p); a prompt's sampled tokens
        depend on the seed (default 0) and the prompt's index only, not on what runs beside it.
        Stops a sequence at any of `stop_tokens` (default: the model's eos ids), at
        max_new_tokens or at max_seq. `callback(step, tokens)` is called after every step that
        produced tokens, with each prompt's new token (None for prompts without one). Under
        tensor parallelism every rank calls this; rank 0 schedules, and every rank returns the
        result."""
        if self.kind == "encoder":
            raise UserError(f"generate: {self.artifact.path} is an embedding (encoder) model; use dsc.LLM(...).embed")
        from dsc.runtime.executor import EngineCore, follow, release_followers
        from dsc.runtime.scheduler import SeqParams
        from dsc.runtime.scheduler import Sequence as Seq

        prompt_ids = [list(p) for p in prompts]
        self.check_batch(prompt_ids, batch_limit=False)
        check_sampling(temperature, top_k, top_p, max_new_tokens, seed)
        stops = set(
            check_token_ids(
                self.eos_token_ids if stop_tokens is None else stop_tokens, self.vocab_size, "generate: stop token"
            )
        )
        if self.rank != 0:
            follow(self)
            return self._result_from_rank0(None)
        try:
            core = EngineCore.for_engine(self, max_num_batched_tokens)
            seqs = []
            for i, p in enumerate(prompt_ids):
                params = SeqParams(
                    max_tokens=max_new_tokens,
                    temperature=float(temperature),
                    top_k=top_k,
                    top_p=float(top_p),
                    seed=((0 if seed is None else seed) + i) % 2**63,
                    stop_token_ids=frozenset(stops),
                )
                seq = Seq(str(i), p, params, index=i)
                core.scheduler.add(seq, where=f"generate: prompt {i}")
                seqs.append(seq)
            step, seen = 0, [0] * len(seqs)
            while core.has_work():
                core.step()
                while callback and any(len(s.output_ids) > n for s, n in zip(seqs, seen)):
                    emitted: list[int | None] = [None] * len(seqs)
                    for s in seqs:
                        if len(s.output_ids) > seen[s.index]:
                            emitted[s.index] = s.output_ids[seen[s.index]]
                            seen[s.index] += 1
                    callback(step, emitted)
                    step += 1
        finally:
            release_followers(self)
        result = GenerateResult([s.output_ids for s in seqs], [s.finish_reason or "length" for s in seqs])
        return self._result_from_rank0(result)

    def _result_from_rank0(self, result: GenerateResult | None) -> GenerateResult:
        if self.world == 1:
            assert result is not None  # only ranks other than 0 pass None
            return result
        import torch.distributed as dist

        box = [result]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        out = box[0]
        assert out is not None  # rank 0's result
        return out

    def generate_static(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        callback: Callable[[int, list[int | None]], None] | None = None,
    ) -> GenerateResult:
        """Generate for one static batch (at most max_batch prompts) with the static programs:
        all prompts prefilled together, then decoded in lockstep until the last one stops
        (`dsc bench`'s and the serving benchmark's baseline).

        Greedy when temperature == 0, else sampled (top-k, top-p, seeded). Stops a sequence at
        any of `stop_tokens` (default: the model's eos ids), at max_new_tokens or at max_seq.
        `callback(step, tokens)` is called after every step with each sequence's new token
        (None for sequences already finished).
        Pipelined: step t + 1's decode and sampling are queued on the device (from step t's
        tokens, which never leave it) before the host reads step t's tokens, so on a GPU the
        host's per-step work (the read-back, stop checks, callback, the next launches) runs
        while the GPU decodes, and under tensor parallelism no rank waits for another's host
        between steps. The tokens, sampled ones included, are those of the unpipelined loop;
        when every sequence stops, the one step already queued is discarded."""
        self._no_stages("generate_static")
        prompts = [list(p) for p in prompts]
        self.check_batch(prompts)
        check_sampling(temperature, top_k, top_p, max_new_tokens, seed)
        stops = set(
            check_token_ids(
                self.eos_token_ids if stop_tokens is None else stop_tokens, self.vocab_size, "generate: stop token"
            )
        )
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(0 if seed is None else seed)
        B = len(prompts)
        self.reset()
        out: list[list[int]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        done = [False] * B
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        cuda = self.device.type == "cuda"
        host_tok = torch.empty(B, dtype=torch.long, pin_memory=cuda)  # step t's tokens, read back
        read = torch.cuda.Event() if cuda else None

        def next_tokens(logits: torch.Tensor) -> torch.Tensor:
            tok = sample(logits, temperature, top_k, top_p, gen)
            if self.world > 1:  # keep ranks in lockstep even when sampling
                import torch.distributed as dist

                dist.broadcast(tok, src=0)
            return tok

        def queue(step: int) -> torch.Tensor:  # step + 1's tokens, from step's (on the device)
            # finished rows keep decoding (static batch) at a clamped position; results ignored
            return next_tokens(self.decode(tok, torch.clamp(lens + step, max=self.max_seq - 1)))

        tok = next_tokens(self.prefill(prompts))
        for step in range(max_new_tokens):
            host_tok.copy_(tok, non_blocking=cuda)
            if read is not None:  # CUDA: on the copy's stream (the engine's device, not necessarily the current one)
                read.record(torch.cuda.current_stream(self.device))
            if step < max_new_tokens - 1:  # queue step + 1 before reading step's tokens
                queued = queue(step)
            if read is not None:
                read.synchronize()
            host = host_tok.tolist()
            emitted: list[int | None] = []
            for i, t in enumerate(host):
                if done[i]:
                    emitted.append(None)
                    continue
                out[i].append(t)
                emitted.append(t)
                if t in stops:
                    done[i], reasons[i] = True, "stop"
                elif len(prompts[i]) + len(out[i]) >= self.max_seq:
                    done[i] = True
            if callback:
                callback(step, emitted)
            if all(done) or step == max_new_tokens - 1:
                break
            tok = queued
        return GenerateResult(out, reasons)


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (None on the CPU, where rank files are memory-mapped)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def weights_do_not_fit(path: Path, need: int, free: int, device: torch.device) -> str:
    return (
        f"{path}: the weights need {need / 2**30:.2f} GiB ({need} bytes) on {device}, which has "
        f"{free / 2**30:.2f} GiB ({free} bytes) free; split them over more GPUs (`dsc compile --tp N`), halve "
        "them (`dsc compile --int8`), stream them from host memory (`--offload cpu --gpu-memory GIB`), or run on the "
        "CPU (`--device cpu`)"
    )


def _dist_rank_world(artifact: Artifact, rank: int | None, pp: int = 1) -> tuple[int, int]:
    n = artifact.tp * pp  # every rank that steps together
    what = f"compiled for tp={artifact.tp}" + (f", in {pp} pipeline stages ({n} ranks)" if pp > 1 else "")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world != n:
            raise UserError(f"{artifact.path}: {what}, but the process group has {world} ranks")
        return dist.get_rank(), world
    if "WORLD_SIZE" in os.environ and (n > 1 or int(os.environ["WORLD_SIZE"]) > 1):
        world = int(os.environ["WORLD_SIZE"])
        if world != n:
            raise UserError(f"{artifact.path}: {what}, but WORLD_SIZE={world} (run with --nproc-per-node {n})")
        return int(os.environ["RANK"]), world
    if n > 1 and rank is None:
        raise UserError(
            f"{artifact.path}: {what}; run under torchrun --nproc-per-node {n} "
            "(or `dsc generate`, which starts the ranks itself)"
        )
    if n > 1 and rank is not None and not 0 <= rank < n:
        raise UserError(f"{artifact.path}: rank {rank} is out of range for {n} ranks ({what})")
    if n > 1 and "MASTER_ADDR" not in os.environ:
        raise UserError(
            f"{artifact.path}: {what}; loading rank {rank} needs a process group: call "
            "torch.distributed.init_process_group first, or run under torchrun"
        )
    return (rank or 0), n


def _check_device(device: str | torch.device | None) -> torch.device:
    """The device a user asked for (None: cuda when there is one), as one UserError line when
    torch does not know it or this machine lacks it."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # index below
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"--device: unknown device {str(device)[:40]!r}; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device: the dsc runtime runs on cpu or cuda, not {dev.type!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: this machine has no CUDA GPU (or torch was built without CUDA)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPUs")
    return dev


def load(
    path: str | Path,
    rank: int | None = None,
    device: str | torch.device | None = None,
    verify: bool = True,
    cuda_graphs: bool = True,
    prefill_buckets: bool | None = None,
    require_signature: str | Path | None = None,
    static: bool = True,
    kv_cache_memory: float | None = None,
    max_num_seqs: int | None = None,
    trust_kernels: bool = False,
    offload: str | None = None,
    gpu_memory: float | None = None,
    pipeline_parallel_size: int = 1,
) -> Engine:
    """Load an artifact for one rank. Checks format version and the sha256 of every file this
    rank reads (skip with verify=False). On CUDA, decode steps are captured as CUDA graphs at
    load, one per batch bucket (cuda_graphs=False runs them eagerly). Prefills are right-padded
    to a length bucket where their graphs are captured (runtime/prefill.py), else run at the
    prompts' exact length; prefill_buckets=True pads them without graphs too (the same shapes
    as the graphs, so the same numbers: a GEMM's rounding can depend on its row count, and in
    bf16 that flips near-tie greedy tokens), False never pads. For tp > 1, call under
    torchrun: the process group is initialised here (NCCL on GPU, gloo on CPU) if it is not
    already, and each rank takes the GPU of its LOCAL_RANK. The DSC_* switches
    (switches.py) are read and checked here, on every device, and kept for the engine's life. The artifact is
    untrusted data
    (docs/security.md): its file list, plan structure and rank-file header are checked before
    use, with verify=False too; require_signature=PUBKEY (a public key file from `dsc keygen`)
    also refuses an artifact that is unsigned or altered after `dsc sign`, and implies verify.
    The artifact's ahead-of-time kernel binaries (`dsc compile --target`) are used on a GPU of
    their arch when its signature was verified (require_signature) or with trust_kernels=True
    (runtime/binaries.py); otherwise Triton compiles the kernels from dsc's own sources.
    The ragged program's paged KV pool is sized by kv_cache_memory (GiB; default: 90% of the
    free GPU memory with static=False, else the static cache's size) and its decode steps
    bucketed up to max_num_seqs sequences (default max_batch); static=False leaves out the
    static programs and their [max_batch, max_seq] cache (serving). offload="cpu" or "disk"
    keeps on the device only what fits in gpu_memory GiB (default: the weights outside the
    layers) and streams the other layers from pinned host memory or from the rank file at every
    step (runtime/offload.py; the programs then run without CUDA graphs). pipeline_parallel_size=N
    runs the ragged program in N stages of consecutive layers, one per group of tp ranks
    (world = tp x N, under torchrun; runtime/pipeline.py), without the static programs."""
    switches.check_all()
    from dsc.runtime.offload import check_offload
    from dsc.runtime.pipeline import check_pipeline_parallel_size

    check_offload(offload, gpu_memory)
    check_pipeline_parallel_size(pipeline_parallel_size)
    device = _check_device(device)
    probe = open_artifact(path, ranks=None, verify=False)  # every rank file present, before any rank loads
    r, world = _dist_rank_world(probe, rank, pipeline_parallel_size)
    if device.type == "cuda" and device.index is None:
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", 0)) if world > 1 else torch.cuda.current_device()
        )
    if world > 1:
        from dsc.runtime.distributed import ensure_process_group

        ensure_process_group(device, world, r)
    from dsc.runtime.pipeline import tp_groups

    collectives.set_tp_group(tp_groups(probe.tp, pipeline_parallel_size, r) if pipeline_parallel_size > 1 else None)
    import time

    t = time.perf_counter()
    # the rank file is hashed on its own thread while its weights are copied and the kernels built
    artifact = open_artifact(
        path, ranks=[r % probe.tp], verify=verify, require_signature=require_signature, defer_rank_checksums=True
    )
    from dsc.runtime.binaries import load_binaries

    binaries = load_binaries(artifact, device, trusted=trust_kernels or require_signature is not None)
    try:
        engine = Engine(
            artifact,
            r,
            world,
            device,
            cuda_graphs=cuda_graphs,
            prefill_buckets=prefill_buckets,
            static=static,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            offload=offload,
            gpu_memory=gpu_memory,
            pipeline_parallel_size=pipeline_parallel_size,
        )
    finally:
        t_wait = time.perf_counter()
        artifact.finish_checks()
    done = time.perf_counter()
    # "checksums": the wait for the hashes after everything else had loaded (0 when they were first)
    engine.load_times = {
        **engine.load_times,
        "kernel_binaries": binaries.get("seconds", 0.0),
        "checksums": done - t_wait,
        "total": done - t,
    }
    engine.kernel_binaries = binaries
    return engine
