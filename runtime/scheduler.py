"""Continuous batching: which tokens of which sequences each ragged step computes.

    sched = Scheduler(SchedulerLimits(num_blocks=..., block_size=16, max_num_batched_tokens=2048,
                                      max_num_seqs=256, max_seq=4096))
    sched.add(seq)
    plan = sched.schedule()            # a StepPlan, or None when nothing can run
    ... an executor runs plan.step and samples one token per row of plan.sample ...
    advanced = sched.update(plan, tokens, logprobs)

The scheduler is plain bookkeeping over host lists and a block allocator: it imports no
device code and is unit-tested without an artifact. runtime/executor.py runs its plans.

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

**Tokens in flight.** `schedule()` may run before the tokens of the previous plan are known on
the host (async scheduling: the host plans step t+1 while the device runs step t). A sampled
token the host has not seen yet is *pending*: it counts in the sequence's length, and when the
next step needs it as an input the step names it by its row in the previous step's sampled
tokens (`Step.input_ids` holds -(row + 1); the executor gathers it on the device). `update`
appends it once known, and applies the stop rules then, one step late: a sequence that stopped
on a token (eos, a stop token) may already be in the next plan, whose token for it is dropped.
A sequence whose length limit (max_tokens, max_seq) is reached by its pending tokens is not
scheduled again. Sequences never wait on the host otherwise: with `update` called right after
each plan's tokens (sync stepping) nothing is ever pending, and the tokens are the same.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from dsc.errors import UserError
from dsc.runtime.checks import is_int
from dsc.runtime.kv_pool import BlockPool
from dsc.runtime.ragged import Step


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
    min_tokens: int = 0  # no stop token may be sampled before this many tokens


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
    num_computed: int = 0  # tokens whose keys and values are in the pool (or being computed)
    finish_reason: str | None = None
    num_pending: int = 0  # sampled tokens not yet on the host (after output_ids)
    pending_row: int = -1  # the row of the latest pending token in its step's sampled tokens
    epoch: int = 0  # preemptions so far: a plan made before one no longer holds for the sequence

    def __post_init__(self):
        self._tokens = list(self.prompt_ids) + self.output_ids  # prompt + known output, grown by append

    @property
    def tokens(self) -> list[int]:
        """The known tokens (prompt and output; pending ones excluded)."""
        return self._tokens

    @property
    def length(self) -> int:
        """Prompt + output tokens, pending ones included."""
        return len(self._tokens) + self.num_pending

    @property
    def num_output(self) -> int:
        return len(self.output_ids) + self.num_pending

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self._tokens.append(token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# tokens per step: of the budgets measured on an H200 (docs/performance.md: 512, 2,048, 8,192 on
# the serving workload of Llama-8B), the fastest
DEFAULT_BUDGET = 2048


@dataclass(frozen=True)
class SchedulerLimits:
    """What bounds a step: the KV pool's blocks, the token budget, the sequences at once."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int = DEFAULT_BUDGET
    max_num_seqs: int = 256
    max_seq: int = 2048
    prefix_caching: bool = True

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_seq"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise UserError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {v!r}")


@dataclass
class StepPlan:
    """One step: `step` (host lists) computes entries[i] = (seq, n tokens from start) in order;
    `sample` lists the rows (indices into entries, which are the rows of the step's logits)
    whose sequence catches up and gets its next token."""

    step: Step
    entries: list[tuple[Sequence, int, int, int]]  # (seq, start, n, seq.epoch at planning)
    sample: list[int]
    counters: list[int]  # per sampled row: the index of the token it samples in its sequence's output
    pending_inputs: bool  # some input is a token of the previous step still on the device

    @property
    def sampled_seqs(self) -> list[Sequence]:
        return [self.entries[r][0] for r in self.sample]


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.block_size = limits.block_size
        self.pool = BlockPool(limits.num_blocks, limits.block_size, prefix_caching=limits.prefix_caching)
        self.budget = limits.max_num_batched_tokens
        self.max_num_seqs = limits.max_num_seqs
        self.max_seq = limits.max_seq
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
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
            raise UserError(
                f"{where}: {n_prompt} tokens; the artifact's max_seq is {self.max_seq} (prompt + "
                "at least one generated token; recompile with --max-seq)"
            )
        need = self.blocks_for(min(n_prompt + max_tokens, self.max_seq))
        if need > self.pool.num_blocks:
            raise UserError(
                f"{where}: {n_prompt} prompt tokens + max_tokens {max_tokens} need {need} KV blocks; "
                f"the KV pool holds {self.pool.num_blocks} (give a larger --kv-cache-memory)"
            )

    def add(self, seq: Sequence, where: str = "prompt") -> None:
        self.check_fits(len(seq.prompt_ids), seq.params.max_tokens, where)
        seq.seq_id = next(self._ids)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stopped, aborted) and free its blocks now. A step in flight may still
        write its keys into them: the device runs it before any later step that reuses them."""
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

    def _at_limit(self, seq: Sequence) -> bool:
        """Its pending tokens reach max_tokens or max_seq: it ends once they are known."""
        return seq.num_output >= seq.params.max_tokens or seq.length >= self.max_seq

    # -- planning -------------------------------------------------------------------------------
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
        seq.epoch += 1
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _pick(self) -> list[tuple[Sequence, int]]:
        """The sequences of the next step and how many tokens each brings."""
        budget = self.budget
        planned: list[tuple[Sequence, int]] = []
        # running sequences: decodes first, then prompt chunks (running order = admission order)
        order = sorted((s for s in self.running if not self._at_limit(s)), key=lambda s: s.length - s.num_computed > 1)
        preempted: set[int] = set()
        for seq in order:
            if budget == 0:
                break
            if id(seq) in preempted:  # preempted below for an earlier one
                continue
            n = min(seq.length - seq.num_computed, budget)
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
        # new sequences, in arrival order, while budget, seats and blocks last; a preempted one
        # whose last token is still in flight waits for it
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not self.waiting[0].num_pending:
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

    def schedule(self) -> StepPlan | None:
        """The next step's plan; the sequences' computed counts advance as if it ran."""
        planned = self._pick()
        if not planned:
            return None
        step, entries, sample, counters = Step(), [], [], []
        pending_inputs = False
        bs = self.block_size
        for row, (seq, n) in enumerate(planned):
            start, tokens = seq.num_computed, seq.tokens
            known = min(start + n, len(tokens))
            step.query_start.append(len(step.input_ids))
            step.query_lens.append(n)
            step.cache_lens.append(start)
            step.block_tables.append(seq.block_table)
            step.input_ids += tokens[start:known]
            if known < start + n:  # the one pending token (decode): the previous step's row
                step.input_ids.append(-(seq.pending_row + 1))
                pending_inputs = True
            step.positions += range(start, start + n)
            table = seq.block_table
            step.slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            step.logits_idx.append(len(step.input_ids) - 1)
            if start < len(seq.prompt_ids):
                self.prompt_tokens += min(n, len(seq.prompt_ids) - start)
            entries.append((seq, start, n, seq.epoch))
            seq.num_computed = start + n
            if seq.num_computed == seq.length:  # caught up: its last logits give the next token
                sample.append(row)
                counters.append(seq.num_output)
                seq.num_pending += 1
                seq.pending_row = row
        self.steps += 1
        return StepPlan(step, entries, sample, counters, pending_inputs)

    # -- results --------------------------------------------------------------------------------
    def update(
        self, plan: StepPlan, tokens: list[int], logprobs: list[dict[int, float]] | None = None
    ) -> list[Sequence]:
        """tokens[i]: the token sampled for row plan.sample[i] (logprobs[i] its log-probabilities
        when asked). Registers the blocks the step filled, appends the tokens and applies the stop
        rules; returns the sequences that got a token (finished ones included)."""
        for seq, start, n, epoch in plan.entries:
            if (
                epoch == seq.epoch and not seq.finished and (start + n) // self.block_size > start // self.block_size
            ):  # a block filled
                self.pool.register(seq.block_table, seq.tokens[: start + n])
        out = []
        for i, row in enumerate(plan.sample):
            seq = plan.entries[row][0]
            if seq.finished:  # stopped on an earlier token, or aborted: this one is dropped
                continue
            seq.num_pending -= 1
            t = tokens[i]
            seq.append(t)
            self.generated_tokens += 1
            p = seq.params
            if logprobs is not None and p.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            if t in p.stop_token_ids and len(seq.output_ids) >= p.min_tokens:
                self.finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.max_seq:
                self.finish(seq, "length")
            out.append(seq)
        return out

    def stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used(),
            "prefix_cache_hit_tokens": self.pool.stats.prefix_hits,
            "prompt_tokens_total": self.prompt_tokens,
            "generation_tokens_total": self.generated_tokens,
            "preemptions": self.preemptions,
            "steps": self.steps,
        }
