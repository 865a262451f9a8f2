"""runtime/kv_pool.py: the KV block pool, its reference counts and prefix caching."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dsc.runtime.kv_pool import BlockPool


def _seq(pool: BlockPool, prompt: list[int]) -> list[int]:
    """A sequence's block table for `prompt` as the scheduler builds it, registered as computed."""
    bs = pool.block_size
    table = pool.match_prefix(prompt[:-1])
    more = pool.allocate(-(-len(prompt) // bs) - len(table))
    assert more is not None
    table += more
    pool.register(table, prompt)
    pool.check()
    return table


def test_allocate_free_counts_and_no_leak():
    pool = BlockPool(10, 4)
    a = pool.allocate(3)
    b = pool.allocate(7)
    assert sorted(a + b) == list(range(10))
    assert pool.num_free() == 0 and pool.num_used() == 10
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []
    pool.free(a)
    pool.check()
    assert pool.num_free() == 3 and pool.num_used() == 7
    assert pool.allocate(4) is None and pool.num_free() == 3  # nothing changed
    pool.free(b)
    pool.check()
    assert pool.num_free() == 10 and pool.num_used() == 0


def test_double_free_is_an_error():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(a[:1])
    pool.check()


def test_shared_prefix_blocks_are_counted_and_reused():
    pool = BlockPool(16, 4)
    system = list(range(100, 112))  # 3 full blocks
    t1 = _seq(pool, system + [1, 2, 3])
    assert pool.stats.prefix_hits == 0
    t2 = _seq(pool, system + [7, 8])
    assert t2[:3] == t1[:3] and t2[3] != t1[3]
    assert [pool.ref_count(b) for b in t1[:3]] == [2, 2, 2]
    assert pool.stats.prefix_hits == 12 and pool.stats.prefix_queries == 14 + 13
    pool.free(t1)
    pool.check()
    assert [pool.ref_count(b) for b in t2[:3]] == [1, 1, 1]
    pool.free(t2)
    pool.check()
    assert pool.num_free() == 16 and pool.num_used() == 0
    # all unreferenced now, but the prefix is still cached and found again
    t3 = _seq(pool, system + [9])
    assert t3[:3] == t1[:3]
    pool.free(t3)
    assert pool.num_free() == 16


def test_prompt_last_token_block_is_never_matched():
    pool = BlockPool(8, 4)
    prompt = list(range(8))  # exactly 2 full blocks
    t1 = _seq(pool, prompt)
    t2 = _seq(pool, prompt)
    # prompt[:-1] holds one full block: the block with the last token is computed again
    assert t2[0] == t1[0] and t2[1] != t1[1]
    pool.free(t1)
    pool.free(t2)
    pool.check()


def test_prefix_match_is_position_and_chain_sensitive():
    pool = BlockPool(8, 2)
    t = _seq(pool, [1, 2, 3, 4, 5])
    assert pool.match_prefix([3, 4, 3, 4]) == []  # block [3, 4] exists only after [1, 2]
    assert pool.match_prefix([1, 2, 9, 9]) == [t[0]]
    assert pool.match_prefix([1, 2, 3, 4]) == [t[0], t[1]]
    pool.free([t[0]])
    pool.free([t[0], t[1]])
    pool.free(t)
    pool.check()
    assert pool.num_used() == 0


def test_lru_eviction_order():
    pool = BlockPool(4, 1)
    a, b, c = (pool.allocate(1) for _ in range(3))
    for table, tok in ((a, 1), (b, 2), (c, 3)):
        pool.register(table, [tok])
    pool.free(b)
    pool.free(a)
    pool.free(c)
    assert pool.num_free() == 4 and pool.num_used() == 0
    assert pool.allocate(1) not in (a, b, c)  # a never-used block goes first
    assert pool.stats.evictions == 0
    # then cached blocks, least recently freed first
    assert pool.allocate(2) == b + a and pool.stats.evictions == 2
    assert pool.match_prefix([2]) == [] and pool.match_prefix([1]) == []
    assert pool.match_prefix([3]) == c
    pool.check()


def test_match_takes_cached_blocks_out_of_the_evictable_set():
    pool = BlockPool(3, 2)
    t = _seq(pool, [5, 6, 7])
    pool.free(t)
    assert pool.num_free() == 3
    m = pool.match_prefix([5, 6])
    assert m == [t[0]] and pool.num_free() == 2 and pool.num_used() == 1
    assert pool.allocate(3) is None
    rest = pool.allocate(2)
    assert t[0] not in rest and pool.stats.evictions == 0
    pool.free(m + rest)
    pool.check()


def test_free_releases_a_table_back_to_front():
    pool = BlockPool(3, 2)
    t = pool.allocate(3)
    pool.register(t, [1, 2, 3, 4, 5, 6])
    pool.free(t)
    # the chain's tail is evicted first: its head stays findable longest
    assert pool.allocate(1) == [t[2]]
    assert pool.match_prefix([1, 2, 3, 4, 5, 6]) == t[:2]
    pool.check()


def test_register_is_memoised_and_incremental(monkeypatch):
    from dsc.runtime import kv_pool

    calls = []
    real = kv_pool.chain_digest
    monkeypatch.setattr(kv_pool, "chain_digest", lambda p, t: calls.append(tuple(t)) or real(p, t))
    pool = BlockPool(64, 4)
    tokens = list(range(3))
    table = pool.allocate(1)
    for step in range(100):
        pool.register(table, tokens)
        tokens.append(1000 + step)
        if len(tokens) > 4 * len(table):
            table += pool.allocate(1)
        pool.check()
    # one digest per full block ever, however many times register ran
    assert len(calls) == (len(tokens) - 1) // 4  # the last register saw tokens[:-1]
    assert len(calls) == len(set(calls))
    pool.free(table)


def test_duplicate_contents_register_once():
    pool = BlockPool(8, 2)
    a = pool.allocate(2)
    b = pool.allocate(2)
    pool.register(a, [1, 2, 3, 4])
    pool.register(b, [1, 2, 3, 4])  # computed the same tokens in other blocks
    assert pool.match_prefix([1, 2, 3, 4]) == a
    assert [pool.ref_count(x) for x in a + b] == [2, 2, 1, 1]
    pool.free(a)
    pool.free(a)
    pool.free(b)  # unregistered copies become plain free, not cached
    pool.check()
    assert pool.num_free() == 8
    assert set(pool.allocate(6)) & set(a) == set() and pool.stats.evictions == 0
    assert pool.match_prefix([1, 2, 3, 4]) == a


def test_prefix_caching_off():
    pool = BlockPool(8, 2, prefix_caching=False)
    t = _seq(pool, [1, 2, 3, 4, 5])
    assert pool.match_prefix([1, 2, 3, 4]) == []
    pool.free(t)
    pool.check()
    assert pool.num_free() == 8 and pool.stats.evictions == 0


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
    with pytest.raises(ValueError):
        BlockPool(4, 4).allocate(-1)


class PoolMachine(RuleBasedStateMachine):
    """Sequences come and go: each holds a block table and the tokens its blocks hold. The
    model is the list of live sequences; the pool must agree with it on reference counts and
    never hand out a block whose contents differ from the prefix asked for."""

    @initialize(num_blocks=st.integers(1, 24), bs=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks, bs):
        self.pool = BlockPool(num_blocks, bs)
        self.seqs: list[tuple[list[int], list[int]]] = []  # (tokens computed, table)
        self.contents: dict[int, tuple[int, ...]] = {}  # block -> the prefix it holds, once computed

    def _check_blocks(self, table, tokens):
        bs = self.pool.block_size
        for j, b in enumerate(table[: len(tokens) // bs]):
            want = tuple(tokens[: (j + 1) * bs])
            assert self.contents.get(b, want) == want

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def add_sequence(self, prompt):
        pool, bs = self.pool, self.pool.block_size
        free_before = pool.num_free()
        table = pool.match_prefix(prompt[:-1])
        assert len(table) <= (len(prompt) - 1) // bs
        for j, b in enumerate(table):
            assert self.contents[b] == tuple(prompt[: (j + 1) * bs])  # the right prefix, no false hit
        more = pool.allocate(-(-len(prompt) // bs) - len(table))
        if more is None:
            assert -(-len(prompt) // bs) - len(table) > pool.num_free()
            pool.free(table)
            assert pool.num_free() == free_before
            return
        for b in more:
            self.contents.pop(b, None)
        table += more
        pool.register(table, prompt)
        for j, b in enumerate(table[: len(prompt) // bs]):
            self.contents[b] = tuple(prompt[: (j + 1) * bs])
        self.seqs.append((list(prompt), table))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), n=st.integers(1, 5), tok=st.integers(0, 2))
    def extend(self, i, n, tok):
        tokens, table = self.seqs[i % len(self.seqs)]
        bs = self.pool.block_size
        for _ in range(n):
            if len(tokens) == len(table) * bs:
                more = self.pool.allocate(1)
                if more is None:
                    break
                self.contents.pop(more[0], None)
                table += more
            tokens.append(tok)
            self.pool.register(table, tokens)
            for j, b in enumerate(table[: len(tokens) // bs]):
                self.contents.setdefault(b, tuple(tokens[: (j + 1) * bs]))
        self._check_blocks(table, tokens)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def finish(self, i):
        _, table = self.seqs.pop(i % len(self.seqs))
        self.pool.free(table)

    @rule(n=st.integers(0, 6))
    def allocate_and_free(self, n):
        free = self.pool.num_free()
        got = self.pool.allocate(n)
        assert (got is None) == (n > free)
        if got is not None:
            assert len(set(got)) == n
            for b in got:
                self.contents.pop(b, None)
            self.pool.free(got)

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check()
        refs = Counter(b for _, table in self.seqs for b in table)
        assert all(pool.ref_count(b) == refs[b] for b in range(pool.num_blocks))
        assert pool.num_used() == len(refs)
        assert pool.num_free() + pool.num_used() == pool.num_blocks
        assert pool.stats.prefix_hits <= pool.stats.prefix_queries

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for _, table in self.seqs:
            self.pool.free(table)
        self.pool.check()
        assert self.pool.num_free() == self.pool.num_blocks and self.pool.num_used() == 0


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
