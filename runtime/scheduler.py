"""Continuous batching: which tokens of which sequences each ragged step computes.

Every step packs a token budget (`max_num_batched_tokens`) as DeepSpeed-FastGen's Dynamic
SplitFuse does: first every running sequence's next token (decode), then chunks of prompts
still being computed, then new sequences from the queue, in arrival order, while the budget,
`max_num_seqs` and the KV pool's free blocks allow. A long prompt is split into chunks over
several steps, each fused with the running decodes, so every step does about the same work.

KV memory is a pool of fixed-size blocks (runtime/kv_pool.py). A sequence holds the blocks of
its tokens; a new one first takes the cached blocks of its prompt's longest already-computed
prefix (prefix caching: a shared system prompt is computed once). When a running sequence
needs a block and none is free, the most recently admitted sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (prompt and tokens so
far) when blocks are free again; its tokens are unchanged by that. A finished or aborted
sequence frees its blocks at once.

Sampling is per sequence, batched on the device (runtime/sampling.py `sample_batch`): the
randomness of a sequence's n-th token depends only on its seed and n, so a seeded request gets
the same tokens whatever else runs with it, preempted or not.

Under tensor parallelism rank 0 schedules and broadcasts each step (`pack`ed) to the other
ranks before running it; they run the same step (`follow`). This module imports no compiler code.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from dsc.errors import UserError
from dsc.runtime.kv_pool import BlockPool
from dsc.runtime.ragged import Step, pack
from dsc.runtime.sampling import logprobs as token_logprobs
from dsc.runtime.sampling import sample_batch


@dataclass
class SeqParams:
    """A sequence's sampling and stopping rules, resolved (no None left)."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # top alternatives per token (0: the chosen token's only)


@dataclass(eq=False)  # compared by identity: a sequence is one object
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SeqParams
    index: int = 0  # the request's n-th sequence
    seq_id: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the pool
    finish_reason: str | None = None
    new_tokens: int = 0  # tokens added by the last step

    def __post_init__(self):
        self._tokens = list(self.prompt_ids) + self.output_ids  # prompt + output, grown by append

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self._tokens.append(token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


STOP = torch.tensor([-1, 0, 0], dtype=torch.long)  # what rank 0 broadcasts when the followers may return


class Scheduler:
    def __init__(self, engine, max_num_batched_tokens: int = 512, max_num_seqs: int | None = None,
                 prefix_caching: bool = True):
        pool = engine.plan["kv_pool"]
        if isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int) \
                or max_num_batched_tokens < 1:
            raise UserError(f"--max-num-batched-tokens: expected an integer >= 1, got {max_num_batched_tokens!r}")
        self.engine = engine
        self.block_size = pool["block_size"]
        num_blocks = next(iter(engine.kv_pool.values())).shape[0]
        self.pool = BlockPool(num_blocks, self.block_size, prefix_caching=prefix_caching)
        self.budget = max_num_batched_tokens
        self.max_num_seqs = min(max_num_seqs or engine.max_num_seqs, engine.max_num_seqs)
        self.max_seq = engine.max_seq
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        engine.ragged.warm_up(self.budget)
        self.steps = 0
        self.preemptions = 0
        self.prompt_tokens = 0  # prompt tokens computed (cached ones not counted)
        self.generated_tokens = 0

    # -- requests -----------------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def check_fits(self, n_prompt: int, max_tokens: int, where: str = "prompt") -> None:
        """A sequence must fit max_seq and, alone, the pool: else it could never run."""
        if n_prompt + 1 > self.max_seq:
            raise UserError(f"{where}: {n_prompt} tokens; the artifact's max_seq is {self.max_seq} (prompt + "
                            "at least one generated token; recompile with --max-seq)")
        need = self.blocks_for(min(n_prompt + max_tokens, self.max_seq))
        if need > self.pool.num_blocks:
            raise UserError(f"{where}: {n_prompt} prompt tokens + max_tokens {max_tokens} need {need} KV blocks; "
                            f"the KV pool holds {self.pool.num_blocks} (give a larger --kv-cache-memory)")

    def add(self, seq: Sequence, where: str = "prompt") -> None:
        self.check_fits(len(seq.prompt_ids), seq.params.max_tokens, where)
        seq.seq_id = next(self._ids)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stopped, aborted) and free its blocks now."""
        if seq.finish_reason is None:
            seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------
    def _grow(self, seq: Sequence, n: int) -> bool:
        """Blocks for seq's next n tokens."""
        need = self.blocks_for(seq.num_computed + n) - len(seq.block_table)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        seq.block_table += got
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table, seq.num_computed = [], 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The sequences of the next step and how many tokens each brings."""
        budget = self.budget
        planned: list[tuple[Sequence, int]] = []
        # running sequences: decodes first, then prompt chunks (running order = admission order)
        order = sorted(self.running, key=lambda s: len(s.tokens) - s.num_computed > 1)
        preempted: set[int] = set()
        for seq in order:
            if budget == 0:
                break
            if id(seq) in preempted:  # preempted below for an earlier one
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(id(victim))
                if victim is seq:
                    break
            if id(seq) not in preempted:
                planned.append((seq, n))
                budget -= n
        running = set(map(id, self.running))
        planned = [(s, n) for s, n in planned if id(s) in running]
        # new sequences, in arrival order, while budget, seats and blocks last
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.tokens
            cached = self.pool.match_prefix(tokens[:-1])  # the last token is computed: its logits are needed
            seq.block_table, seq.num_computed = list(cached), len(cached) * self.block_size
            n = min(len(tokens) - seq.num_computed, budget)
            if not self._grow(seq, n):
                self.pool.free(seq.block_table)
                seq.block_table, seq.num_computed = [], 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            planned.append((seq, n))
            budget -= n
        return planned

    def build(self, planned: list[tuple[Sequence, int]]) -> Step:
        step = Step()
        bs = self.block_size
        for seq, n in planned:
            start, tokens = seq.num_computed, seq.tokens
            step.query_start.append(len(step.input_ids))
            step.query_lens.append(n)
            step.cache_lens.append(start)
            step.block_tables.append(seq.block_table)
            step.input_ids += tokens[start:start + n]
            step.positions += range(start, start + n)
            step.slot_mapping += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            step.logits_idx.append(len(step.input_ids) - 1)
        return step

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a token this step (finished ones included)."""
        for seq in self.running:
            seq.new_tokens = 0
        planned = self.schedule()
        if not planned:
            return []
        packed = pack(self.build(planned))
        if self.engine.world > 1:
            broadcast_step(packed)
        logits = self.engine.ragged(packed)  # [N, V]
        self.steps += 1
        done: list[tuple[int, Sequence]] = []
        for i, (seq, n) in enumerate(planned):
            if seq.num_computed < len(seq.prompt_ids):
                self.prompt_tokens += min(n, len(seq.prompt_ids) - seq.num_computed)
            if (seq.num_computed + n) // self.block_size > seq.num_computed // self.block_size:  # a block filled
                self.pool.register(seq.block_table, seq.tokens[:seq.num_computed + n])
            seq.num_computed += n
            if seq.num_computed == len(seq.tokens):  # caught up: its last logits give the next token
                done.append((i, seq))
        if not done:
            return []
        rows = torch.tensor([i for i, _ in done], device=logits.device)
        tokens, lps = self._sample(logits.index_select(0, rows).float(), [s for _, s in done])
        out = []
        for j, (_, seq) in enumerate(done):
            t = tokens[j]
            seq.append(t)
            seq.new_tokens = 1
            self.generated_tokens += 1
            if lps is not None and seq.params.logprobs is not None:
                seq.logprobs.append(lps[j])
            p = seq.params
            if t in p.stop_token_ids:
                self.finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.max_seq:
                self.finish(seq, "length")
            out.append(seq)
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict] | None]:
        dev = logits.device
        ps = [s.params for s in seqs]
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32).to(dev, non_blocking=True)
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long).to(dev, non_blocking=True)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32).to(dev, non_blocking=True)
        seed = torch.tensor([p.seed for p in ps], dtype=torch.long).to(dev, non_blocking=True)
        counter = torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long).to(dev, non_blocking=True)
        tokens = sample_batch(logits, temp, top_k, top_p, seed, counter,
                              any_sampled=any(p.temperature > 0 for p in ps),
                              any_top_k=any(p.top_k > 0 and p.temperature > 0 for p in ps),
                              any_top_p=any(p.top_p < 1 and p.temperature > 0 for p in ps))
        want = [p.logprobs for p in ps if p.logprobs is not None]
        if not want:
            return tokens.tolist(), None
        k = max(want)
        chosen, top_ids, top_lps = token_logprobs(logits, tokens, k)
        host_tokens = tokens.tolist()
        chosen, top_ids, top_lps = chosen.tolist(), top_ids.tolist(), top_lps.tolist()
        lps = []
        for j, p in enumerate(ps):
            n = p.logprobs or 0
            d = {host_tokens[j]: chosen[j]}
            for tid, lp in zip(top_ids[j][:n], top_lps[j][:n]):
                d.setdefault(tid, lp)
            lps.append(d)
        return host_tokens, lps

    def stats(self) -> dict:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_blocks_total": self.pool.num_blocks, "kv_blocks_used": self.pool.num_used(),
                "prefix_cache_hit_tokens": self.pool.stats.prefix_hits, "prompt_tokens_total": self.prompt_tokens,
                "generation_tokens_total": self.generated_tokens, "preemptions": self.preemptions,
                "steps": self.steps}


def broadcast_step(packed: torch.Tensor) -> None:
    """Rank 0: send a packed step (or STOP) to the other ranks."""
    import torch.distributed as dist

    dev = _comm_device()
    size = torch.tensor([packed.numel()], dtype=torch.long, device=dev)
    dist.broadcast(size, src=0)
    dist.broadcast(packed.to(dev), src=0)


def follow(engine) -> None:
    """Ranks > 0: run the steps rank 0 broadcasts, until it broadcasts STOP."""
    import torch.distributed as dist

    dev = _comm_device()
    while True:
        size = torch.zeros(1, dtype=torch.long, device=dev)
        dist.broadcast(size, src=0)
        packed = torch.zeros(int(size.item()), dtype=torch.long, device=dev)
        dist.broadcast(packed, src=0)
        packed = packed.cpu()
        if int(packed[0]) < 0:
            return
        engine.ragged(packed)


def _comm_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
