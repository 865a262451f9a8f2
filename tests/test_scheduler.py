"""The scheduler and the step loop with no artifact: a fake device keeps a paged KV store (one
token id per slot) and computes each sequence's next token from the tokens it reads back
through its block table, so a wrong slot, block table, prefix hit, preemption or pending input
changes the tokens. Checked against the same function applied to each sequence alone."""

from __future__ import annotations

import random

import pytest

from dsc.errors import UserError
from dsc.runtime.executor import EngineCore, Launched
from dsc.runtime.scheduler import Scheduler, SchedulerLimits, SeqParams, Sequence

V = 97
EOS = 5


def next_token(context: list[int]) -> int:
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return h % V


class FakeExecutor:
    """Runs plans like runtime/executor.py: pending inputs (-(r + 1)) are the previous step's
    sampled rows; every step writes its tokens' slots; min_tokens masks the stop tokens."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.kv: dict[int, int] = {}
        self.prev: list[int] | None = None
        self.launches = 0

    def launch(self, plan) -> Launched:
        st = plan.step
        ids = [self.prev[-t - 1] if t < 0 else t for t in st.input_ids]
        assert plan.pending_inputs == any(t < 0 for t in st.input_ids)
        for t, slot in zip(ids, st.slot_mapping):
            self.kv[slot] = t
        rows = []
        for _i, (start, n, table) in enumerate(zip(st.cache_lens, st.query_lens, st.block_tables)):
            ctx = [self.kv[table[p // self.bs] * self.bs + p % self.bs] for p in range(start + n)]
            rows.append(next_token(ctx))
        for r, c in zip(plan.sample, plan.counters):
            p = plan.entries[r][0].params
            if c < p.min_tokens and rows[r] in p.stop_token_ids:
                rows[r] = (rows[r] + 1) % V  # the next best token, as masking the stop token gives
        self.prev = rows
        self.launches += 1
        return Launched(tokens=[rows[r] for r in plan.sample], done=None)

    def collect(self, launched):
        return list(launched.tokens), None


def reference(prompt: list[int], p: SeqParams, max_seq: int, stop_text: tuple[int, ...] = ()) -> list[int]:
    out: list[int] = []
    while True:
        t = next_token(prompt + out)
        if len(out) < p.min_tokens and t in p.stop_token_ids:
            t = (t + 1) % V
        out.append(t)
        if t in p.stop_token_ids or len(out) >= p.max_tokens or len(prompt) + len(out) >= max_seq:
            return out
        if stop_text and tuple(out[-len(stop_text) :]) == stop_text:
            return out


def run(reqs, limits: SchedulerLimits, async_scheduling: bool, stop_text: tuple[int, ...] = (), arrive=True):
    """reqs: (arrival step, prompt, params). A 'stop string' (a token sequence, checked after each
    update as LLMEngine's detokenizer does) ends a sequence by scheduler.finish."""
    core = EngineCore(Scheduler(limits), FakeExecutor(limits.block_size), async_scheduling)
    seqs = [Sequence(str(i), list(p), sp) for i, (_, p, sp) in enumerate(reqs)]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i][0])
    step = 0
    while order or core.has_work():
        while order and (not arrive or reqs[order[0]][0] <= step or not core.has_work()):
            core.scheduler.add(seqs[order.pop(0)])
        for s in core.step():
            if stop_text and not s.finished and tuple(s.output_ids[-len(stop_text) :]) == stop_text:
                core.scheduler.finish(s, "stop")
        step += 1
    pool = core.scheduler.pool
    pool.check()
    assert pool.num_used() == 0
    return seqs, core


def workload(n, max_prompt, max_new, seed=0, shared=0, stop=frozenset(), min_tokens=0):
    rng = random.Random(seed)
    system = [rng.randrange(V) for _ in range(shared)]
    return [
        (
            rng.randint(0, 20),
            system + [rng.randrange(V) for _ in range(rng.randint(1, max_prompt))],
            SeqParams(max_tokens=rng.randint(1, max_new), stop_token_ids=stop, min_tokens=min_tokens),
        )
        for _ in range(n)
    ]


LIMITS = dict(block_size=4, max_num_seqs=6, max_seq=96)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("budget, blocks", [(1, 64), (5, 64), (64, 64), (64, 16), (512, 30)])
def test_tokens_equal_each_sequence_alone(async_scheduling, budget, blocks):
    """Chunked prompts (budget 1, 5), a full batch, and a pool short enough to preempt."""
    reqs = workload(30, 40, 24, seed=budget + blocks)
    seqs, core = run(
        reqs, SchedulerLimits(num_blocks=blocks, max_num_batched_tokens=budget, **LIMITS), async_scheduling
    )
    for s, (_, p, sp) in zip(seqs, reqs):
        assert s.output_ids == reference(p, sp, 96), s.request_id
        assert s.finish_reason == "length" and s.num_pending == 0
    if blocks == 16:
        assert core.scheduler.preemptions > 0


def test_async_overlaps_and_equals_sync():
    """The same tokens, and async keeps one step in flight: it never collects the step it just
    launched while the queue has work."""
    reqs = workload(20, 30, 30, seed=7, stop=frozenset({EOS}))
    limits = SchedulerLimits(num_blocks=40, max_num_batched_tokens=32, **LIMITS)
    a, ca = run(reqs, limits, True)
    s, cs = run(reqs, limits, False)
    assert [x.output_ids for x in a] == [x.output_ids for x in s]
    assert [x.finish_reason for x in a] == [x.finish_reason for x in s]
    # a sequence stopping on eos had one more step launched for it (its token dropped)
    assert ca.executor.launches >= cs.executor.launches


def _prompts_whose_first_token_is(token: int, n: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = (list(rng.randrange(V) for _ in range(6)) for _ in range(4000))
    found = [p for p in prompts if next_token(p) == token][:n]
    assert len(found) == n
    return found


def test_eos_on_the_pending_token_drops_the_speculative_one():
    """Prompts whose first generated token is eos: async has launched the next step for them
    before it sees the eos; that token is dropped, and the blocks are freed."""
    prompts = _prompts_whose_first_token_is(EOS, 3)
    sp = SeqParams(max_tokens=10, stop_token_ids=frozenset({EOS}))
    for async_scheduling, launches in ((True, 2), (False, 1)):
        seqs, core = run([(0, p, sp) for p in prompts], SchedulerLimits(num_blocks=20, **LIMITS), async_scheduling)
        for s in seqs:
            assert s.output_ids == [EOS] and s.finish_reason == "stop"
        assert core.executor.launches == launches


def test_min_tokens_holds_off_the_stop_token():
    prompts = _prompts_whose_first_token_is(EOS, 2)
    reqs = [(0, p, SeqParams(max_tokens=8, stop_token_ids=frozenset({EOS}), min_tokens=3)) for p in prompts]
    for async_scheduling in (True, False):
        seqs, _ = run(reqs, SchedulerLimits(num_blocks=20, **LIMITS), async_scheduling)
        for s, (_, p, sp) in zip(seqs, reqs):
            assert len(s.output_ids) >= 3 and EOS not in s.output_ids[:3]
            assert s.output_ids == reference(p, sp, 96)


def test_max_tokens_reached_by_pending_tokens_schedules_no_more():
    """A sequence whose last allowed token is in flight is not scheduled again: no step is
    launched past max_tokens (length stops cost nothing extra)."""
    sp = SeqParams(max_tokens=5)
    seqs, core = run([(0, [1, 2, 3], sp)], SchedulerLimits(num_blocks=8, **LIMITS), True)
    assert len(seqs[0].output_ids) == 5
    assert core.executor.launches == 5  # the prompt's step, then 4 decodes


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_stop_string_on_the_pending_token(async_scheduling):
    """A 'stop string' found after an update ends the sequence; in async mode its next token is
    already in flight and is dropped."""
    reqs = workload(16, 20, 30, seed=11)
    stop_text = None
    for _, p, sp in reqs:  # a two-token sequence some output contains
        out = reference(p, sp, 96)
        if len(out) >= 6:
            stop_text = tuple(out[3:5])
            break
    seqs, _ = run(
        reqs, SchedulerLimits(num_blocks=64, max_num_batched_tokens=16, **LIMITS), async_scheduling, stop_text=stop_text
    )
    for s, (_, p, sp) in zip(seqs, reqs):
        assert s.output_ids == reference(p, sp, 96, stop_text)


def test_prefix_hits_and_admission_order():
    reqs = workload(8, 10, 6, seed=3, shared=17)
    for i in range(len(reqs)):
        reqs[i] = (0 if i == 0 else 5, reqs[i][1], reqs[i][2])
    seqs, core = run(reqs, SchedulerLimits(num_blocks=64, max_num_batched_tokens=64, **LIMITS), True)
    for s, (_, p, sp) in zip(seqs, reqs):
        assert s.output_ids == reference(p, sp, 96)
    assert core.scheduler.pool.stats.prefix_hits == 7 * 16  # 4 full blocks of the shared 17 tokens
    assert [s.seq_id for s in seqs] == sorted(s.seq_id for s in seqs)


def test_admission_respects_seats_budget_and_blocks():
    sched = Scheduler(
        SchedulerLimits(num_blocks=6, block_size=4, max_num_batched_tokens=10, max_num_seqs=2, max_seq=64)
    )
    seqs = [Sequence(str(i), list(range(1, 9)), SeqParams(max_tokens=4)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    # 10 tokens: the first prompt whole (8), 2 of the second; the third waits for a seat
    assert [(e[0].request_id, e[1], e[2]) for e in plan.entries] == [("0", 0, 8), ("1", 0, 2)]
    assert plan.sample == [0] and len(sched.waiting) == 1
    with pytest.raises(UserError, match="max_seq is 64"):
        sched.check_fits(64, 1)
    with pytest.raises(UserError, match="KV pool holds 6"):
        sched.check_fits(20, 10)


@pytest.mark.parametrize("field, value", [("num_blocks", 0), ("max_num_batched_tokens", True), ("max_num_seqs", 1.5)])
def test_limits_are_checked(field, value):
    kw = dict(num_blocks=4, block_size=4)
    kw[field] = value
    with pytest.raises(UserError, match=field.replace("_", "-")):
        SchedulerLimits(**kw)
