"""The prefix cache against a reference model, driven by random insert / match / lock / unlock / evict."""
import math

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.cache.pool import KVPool
from prefixcache.cache.radix import PrefixCache, chain_keys

BS = 4
SCOPES = [b"tenant-a" * 2, b"tenant-b" * 2]
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=26)  # a tiny alphabet, so prefixes collide


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = KVPool(1, 1, 2, BS, budget_bytes=40 * 2 * BS * 2 * 4, dtype=torch.float32)  # 40 blocks
        self.cache = PrefixCache(self.pool)
        self.paths: dict[bytes, set[tuple[int, ...]]] = {s: set() for s in SCOPES}  # cached token paths
        self.locks: list[tuple[bytes, tuple[int, ...], list[int]]] = []  # (scope, path, blocks held)

    def _match(self, scope: bytes, tokens: list[int]):
        keys = chain_keys(tokens, [scope] * (len(tokens) // BS), BS)
        return self.cache.match(tokens, keys, [scope] * len(keys), (scope,), len(tokens) - 1), keys

    def _expected(self, scope: bytes, tokens: list[int]) -> int:
        best = 0
        for path in self.paths[scope]:
            n = 0
            while n < min(len(path), len(tokens)) and path[n] == tokens[n]:
                n += 1
            best = max(best, n)
        return min(best, len(tokens) - 1)

    @rule(scope=st.sampled_from(SCOPES), tokens=tokens_st, keep_locked=st.booleans())
    def request(self, scope, tokens, keep_locked):
        """A request: match, lock the hit, allocate the rest, publish its full blocks."""
        m, keys = self._match(scope, tokens)
        assert len(m) == self._expected(scope, tokens)
        for n in m.nodes:
            self.pool.ref(n.block)
        needed = math.ceil(len(tokens) / BS) - len(m.nodes)
        if needed > self.pool.num_free:
            self.cache.evict(needed - self.pool.num_free)
            self._sync_after_eviction()
        if needed > self.pool.num_free:  # does not fit: the request waits (here: gives up)
            for n in m.nodes:
                self.pool.unref(n.block)
            return
        table = [n.block for n in m.nodes] + self.pool.allocate(needed)
        parent = m.nodes[-1] if m.nodes else None
        for j in range(len(m.nodes), len(keys)):
            node, _ = self.cache.insert(parent, keys[j], scope, tuple(tokens[j * BS:(j + 1) * BS]), table[j], None, 0)
            parent = node
            self.paths[scope].add(tuple(tokens[:(j + 1) * BS]))
        if keep_locked:
            self.locks.append((scope, tuple(tokens[:len(keys) * BS]), table))
        else:
            for b in table:
                self.pool.unref(b)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        _, _, table = self.locks.pop(i % len(self.locks))
        for b in table:
            self.pool.unref(b)

    @rule(n=st.integers(1, 50))
    def evict(self, n):
        self.cache.evict(n)
        self._sync_after_eviction()

    def _sync_after_eviction(self):
        """What is left must include every locked path; the reference forgets what was evicted."""
        live = {s: set() for s in SCOPES}
        for node in self.cache.nodes.values():
            path = []
            cur = node
            while cur.parent is not None:
                path[:0] = cur.tokens
                cur = cur.parent
            live[node.scope].add(tuple(path))
        for scope, path, _ in self.locks:  # locked blocks (and so their ancestors) survive
            for j in range(1, len(path) // BS + 1):
                assert path[:j * BS] in live[scope]
        self.paths = live

    @rule(scope=st.sampled_from(SCOPES), tokens=tokens_st)
    def match_only(self, scope, tokens):
        assert len(self._match(scope, tokens)[0]) == self._expected(scope, tokens)

    @invariant()
    def within_budget(self):
        held = {n.block for n in self.cache.nodes.values()} | {b for *_, t in self.locks for b in t}
        assert len(held) + self.pool.num_free == self.pool.usable_blocks
        assert all(r >= 0 for r in self.pool.refs)


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCache = CacheMachine.TestCase
