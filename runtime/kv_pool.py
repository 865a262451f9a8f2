"""The paged KV cache's block allocator, with prefix caching.

The KV cache is one pool of fixed-size blocks (per layer, all layers indexed alike); a sequence
holds a block table, a list of block ids. This module only does the bookkeeping: which blocks
are free, which are referenced (and how often), and which hold a known prefix.

A block is in exactly one of three states:
- plain free: holds nothing anyone can find; allocatable;
- cached: no sequence references it, but its contents are registered under a chain hash, so a
  later prompt with the same prefix can take it back (`match_prefix`); allocatable too, by
  evicting it (least recently freed first), which forgets its hash;
- used: referenced by one or more sequences (shared blocks have a count above 1).

Chain hash of block j of a token sequence (bs = block_size):
    digest_j = sha256(digest_{j-1} || int64 bytes of tokens[j*bs:(j+1)*bs]),  digest_{-1} = b""
so a block's digest names its whole prefix, and identical digests mean identical prefixes (sha256:
no collision on adversarial prompts, unlike Python's hash()).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class PoolStats:
    prefix_queries: int = 0  # tokens passed to match_prefix
    prefix_hits: int = 0  # of those, tokens found in cached blocks
    evictions: int = 0  # cached blocks taken back for allocation (their hash forgotten)


def chain_digest(parent: bytes, block_tokens: Sequence[int]) -> bytes:
    """The digest of one block, given its parent's digest (b"" for the first block)."""
    return hashlib.sha256(parent + array("q", block_tokens).tobytes()).digest()


class BlockPool:
    """Reference-counted KV blocks with LRU-evicted prefix caching.

    pool = BlockPool(num_blocks, block_size)
    table = pool.match_prefix(prompt[:-1])             # shared blocks of a cached prefix
    table += pool.allocate(blocks_needed - len(table))  # None when the pool is short
    ... a step computes tokens ...
    pool.register(table, computed_tokens)              # make the full blocks findable
    pool.free(table)                                    # the sequence ended or was preempted
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool: num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.stats = PoolStats()
        self._refs = [0] * num_blocks
        self._plain: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self._used = 0
        self._block_of: dict[bytes, int] = {}  # digest -> the block registered under it
        self._hash_of: dict[int, bytes] = {}  # its inverse
        # block -> its chain digest, known once register() walked it, whether or not it is the
        # block registered under that digest; forgotten when the block is allocated again
        self._chain: dict[int, bytes] = {}

    def num_free(self) -> int:
        """Blocks allocatable now: plain free ones and cached ones no sequence references."""
        return len(self._plain) + len(self._cached)

    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self._used

    def ref_count(self, block: int) -> int:
        """How many sequences reference the block."""
        return self._refs[block]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with one reference each: plain free blocks first, then cached ones,
        least recently freed first (forgetting their hash). None, changing nothing, when fewer
        than n are allocatable."""
        if n < 0:
            raise ValueError(f"BlockPool.allocate: n must be >= 0, got {n}")
        if n > self.num_free():
            return None
        blocks = []
        for _ in range(n):
            if self._plain:
                b = self._plain.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self.stats.evictions += 1
            self._chain.pop(b, None)
            self._refs[b] = 1
            blocks.append(b)
        self._used += n
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block. `blocks` is a block table (or its tail) in table
        order; it is released back to front, so that when a chain's blocks become evictable its
        later blocks go before its head (a prefix is only found from its first block on). A block
        left at no reference stays cached if it holds a registered hash, else becomes plain free."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise ValueError(f"BlockPool.free: block {b} is not in use")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._used -= 1
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    self._plain.append(b)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest run of full blocks at the start of token_ids,
        each taken with one more reference (a cached block leaves the evictable set).

        The caller passes only tokens whose KV it does not need computed: never the prompt's
        last token, whose logits the step must produce, e.g. `match_prefix(prompt[:-1])`."""
        self.stats.prefix_queries += len(token_ids)
        if not self.prefix_caching:
            return []
        bs, digest, found = self.block_size, b"", []
        for j in range(len(token_ids) // bs):
            digest = chain_digest(digest, token_ids[j * bs : (j + 1) * bs])
            b = self._block_of.get(digest)
            if b is None:
                break
            found.append(b)
        for b in found:
            if self._refs[b] == 0:
                del self._cached[b]
                self._used += 1
            self._refs[b] += 1
        self.stats.prefix_hits += len(found) * bs
        return found

    def register(self, block_table: Sequence[int], token_ids: Sequence[int]) -> None:
        """Give every full block of token_ids (block_table[j] holds tokens[j*bs:(j+1)*bs]) its
        chain digest, so later prompts find it. Blocks walked before are skipped: calling this
        every step costs O(new full blocks). A digest already held by another block leaves this
        block unregistered (its descendants still register under the chain)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(len(token_ids) // bs, len(block_table))
        start = full
        while start > 0 and block_table[start - 1] not in self._chain:
            start -= 1
        digest = self._chain[block_table[start - 1]] if start else b""
        for j in range(start, full):
            b = block_table[j]
            digest = chain_digest(digest, token_ids[j * bs : (j + 1) * bs])
            self._chain[b] = digest
            if digest not in self._block_of and b not in self._hash_of:
                self._block_of[digest] = b
                self._hash_of[b] = digest

    def check(self) -> None:
        """Assert the internal invariants (tests call it after every operation)."""
        plain, cached = set(self._plain), set(self._cached)
        used = {b for b, r in enumerate(self._refs) if r > 0}
        assert all(r >= 0 for r in self._refs), "negative reference count"
        assert len(plain) == len(self._plain), "a block is twice on the free list"
        assert not (plain & cached or plain & used or cached & used), "block states overlap"
        assert plain | cached | used == set(range(self.num_blocks)), "a block is in no state"
        assert len(used) == self._used, "used count drifted"
        assert cached <= set(self._hash_of), "a cached block has no hash"
        assert not plain & set(self._hash_of), "a plain free block keeps a hash"
        assert {b: h for h, b in self._block_of.items()} == self._hash_of, "hash maps disagree"
