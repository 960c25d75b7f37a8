"""The prefix cache against a reference model, driven through the real BlockManager by random requests, releases
and evictions."""
from collections import Counter

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.cache.pool import KVPool
from prefixcache.cache.scope import CacheScope
from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.sequence import SamplingParams, Sequence

BS = 4
SCOPES = [CacheScope(tenant="a"), CacheScope(tenant="b")]
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=26)  # a tiny alphabet, so prefixes collide


class CacheMachine(RuleBasedStateMachine):
    """Requests go through the real BlockManager (match, admit, publish, release) over a 40-block pool."""

    def __init__(self):
        super().__init__()
        self.pool = KVPool(1, 1, 2, BS, budget_bytes=41 * 2 * BS * 2 * 4, dtype=torch.float32)
        self.blocks = BlockManager(self.pool, True, 0, None, [])
        self.cache = self.blocks.cache
        self.paths: dict[bytes, set[tuple[int, ...]]] = {s.key: set() for s in SCOPES}  # cached token paths
        self.locks: list[tuple[CacheScope, tuple[int, ...], Sequence]] = []  # running requests and their paths

    def _expected(self, scope: CacheScope, tokens: list[int]) -> int:
        best = 0
        for path in self.paths[scope.key]:
            n = 0
            while n < min(len(path), len(tokens)) and path[n] == tokens[n]:
                n += 1
            best = max(best, n)
        return min(best, len(tokens) - 1)

    @rule(scope=st.sampled_from(SCOPES), tokens=tokens_st, keep_locked=st.booleans())
    def request(self, scope, tokens, keep_locked):
        """A request: match, admit (lock the hit, allocate the rest), compute, publish; release now or later."""
        seq = Sequence(tokens, SamplingParams(), scope)
        self.blocks.prepare(seq)
        m = self.blocks.match(seq)
        self._check(scope, tokens, m)
        admitted = self.blocks.admit(seq, m)
        self._sync_after_eviction()  # admission may have evicted to make room
        if not admitted:  # does not fit: the request waits (here: gives up)
            return
        seq.num_computed = len(tokens)  # the model ran
        self.blocks.publish(seq)
        full = len(tokens) // BS * BS
        self.paths[scope.key] |= {tuple(tokens[:end]) for end in range(BS, full + 1, BS)}
        if keep_locked:
            self.locks.append((scope, tuple(tokens[:full]), seq))
        else:
            self.blocks.release(seq, finished=False)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        _, _, seq = self.locks.pop(i % len(self.locks))
        self.blocks.release(seq, finished=False)

    @rule(n=st.integers(1, 50))
    def evict(self, n):
        self.cache.evict(n)
        self._sync_after_eviction()

    def _sync_after_eviction(self):
        """What is left must include every locked path; the reference forgets what was evicted."""
        live = {key: set(paths) for key, paths in self._nodes().items()}
        for scope, path, seq in self.locks:  # the blocks a running request shares with the cache (and so their
            # ancestors) survive; one it computed again, as the cached copy had lost its local parts, is its own
            for j, node in enumerate(seq.cache.nodes[:len(path) // BS]):
                if node.block == seq.block_table[j]:
                    assert path[:(j + 1) * BS] in live[scope.key]
        self.paths = live

    def _nodes(self) -> dict[bytes, dict[tuple[int, ...], object]]:
        """Each scope's cached nodes by the token path from its root."""
        nodes = {s.key: {} for s in SCOPES}
        for node in self.cache.nodes.values():
            path = []
            cur = node
            while cur.parent is not None:
                path[:0] = cur.tokens
                cur = cur.parent
            nodes[node.scope][tuple(path)] = node
        return nodes

    @rule(scope=st.sampled_from(SCOPES), tokens=tokens_st)
    def match_only(self, scope, tokens):
        seq = Sequence(tokens, SamplingParams(), scope)
        self.blocks.prepare(seq)
        self._check(scope, tokens, self.blocks.match(seq))

    def _check(self, scope: CacheScope, tokens: list[int], m) -> None:
        assert len(m) == self._expected(scope, tokens)

    @invariant()
    def within_budget(self):
        holders = Counter(n.block for n in self.cache.nodes.values())
        holders.update(b for *_, seq in self.locks for b in seq.block_table)
        assert len(holders) + self.pool.num_free == self.pool.usable_blocks
        assert self.pool.refs[1:] == [holders[b] for b in range(1, self.pool.num_blocks)]  # one ref per holder


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCache = CacheMachine.TestCase


class HybridMachine(CacheMachine):
    """The same with a model of local layers (two of three, a window of 6 tokens: cache/pool.py): a request keeps the
    local parts its window reads, the cache keeps the rest until evicted, alone or with their node; a hit is only
    ever one whose window's local parts are all here."""

    def __init__(self):
        super().__init__()
        self.pool = KVPool(3, 1, 2, BS, budget_bytes=61 * 2 * BS * 2 * 4, dtype=torch.float32, local_layers=(0, 2),
                           window=6)
        self.blocks = BlockManager(self.pool, True, 0, None, [])
        self.cache = self.blocks.cache

    def _check(self, scope: CacheScope, tokens: list[int], m) -> None:
        """No longer than the reference's match, restorable, and at least the longest whole-block prefix of it
        whose window's local parts are all held."""
        longest = self._expected(scope, tokens)
        assert self.cache.restores(m) and len(m) <= longest
        nodes = self._nodes()[scope.key]
        usable = next((n for n in range(longest // BS * BS, 0, -BS)
                       if all(self.pool.has_local(nodes[tuple(tokens[:(j + 1) * BS])].block)
                              for j in range(self.pool.window_start(n), n // BS))), 0)
        assert len(m) >= usable, (len(m), usable, longest)

    @invariant()
    def within_budget(self):
        pool = self.pool
        holders = Counter(n.block for n in self.cache.nodes.values())
        local = Counter(n.block for n in self.cache.nodes.values() if n.local)
        for *_, seq in self.locks:
            holders.update(seq.block_table)
            local.update(seq.block_table[seq.local.start:seq.local.stop])
            assert seq.local.start == max(0, len(seq.tokens) - 5) // BS  # the window of its next token on
        assert [pool.local_refs[b] for b in range(pool.num_blocks)] == [local[b] for b in range(pool.num_blocks)]
        pages = [p for b in local for p in pool.local[b].tolist()]
        assert 0 not in pages and len(set(pages)) == len(pages) == 2 * len(local)
        assert not set(pages) & set(holders)
        assert len(holders) + len(pages) + pool.num_free == pool.usable_blocks
        assert [pool.refs[b] for b in holders] == [holders[b] for b in holders]
        by_owner = Counter()
        for n in self.cache.nodes.values():
            by_owner[self.cache.owner(n)] += 1 + pool.local_pages * n.local
        assert self.cache.pages_by_owner() == by_owner  # what eviction weighs the owners' shares by


HybridMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestHybrid = HybridMachine.TestCase
