"""The prefix cache: a tree of KV blocks keyed by hash chains that start at the scope hash (cache/keys.py).

A match compares stored tokens and the parent link as well as keys, so a hash collision can never serve wrong KV.
Partial blocks (fewer than block_size tokens) hang off the tree as leaves; a hit on one, or on the head of a full
block, is served by copying those tokens (copy-on-write).

Every node holds one pool reference on its block; a running sequence holds its own. A node may be evicted only
when it is an unpinned leaf whose block nobody else references, in cache/eviction.py's order.

With local layers (cache/pool.py), a node also holds its block's local part while it can: an unpinned node's local
part that no sequence reads may be evicted alone, in the same order, wherever the node is in the tree. A hit is
served only where the local parts of the blocks its window reads are all here: a match is cut back until they are.

The cache knows scope keys, tokens and block ids, never a request. Each scope with live entries has an opaque
owner (the engine uses tenant and labels), so that an owner's entries can be purged under every scope it wrote.
Listeners hear of every full block that enters or leaves (while its block still holds its K/V): the engine's tiers
below host memory and KV events. What explains a miss is kept in cache/misses.py.
"""
import time
from collections import Counter
from collections.abc import Callable, Hashable

import numpy as np

from prefixcache.cache.eviction import evict
from prefixcache.cache.keys import block_key
from prefixcache.cache.misses import Misses
from prefixcache.cache.node import Listener, Match, Node, most_saved
from prefixcache.cache.pool import KVPool


class PrefixCache:
    enabled = True

    def __init__(self, pool: KVPool, clock=time.monotonic):
        self.pool = pool
        self.bs = pool.block_size
        self.clock = clock
        self.roots: dict[bytes, Node] = {}
        self.nodes: dict[bytes, Node] = {}
        self.evictions: Counter[str] = Counter()
        self.num_pinned = 0  # blocks that eviction may never take
        self.misses = Misses()
        self.scopes: dict[bytes, list] = {}  # scope key -> [owner, live nodes, adapter, pages]: bounded by the nodes
        self.listeners: list[Listener] = []
        self.shares: dict[Hashable, float] = {}  # owner group -> guaranteed fraction of the pool (set_shares)
        self.group: Callable[[Hashable], Hashable] = lambda owner: owner

    # ---- public API -------------------------------------------------------------------------------------
    def match(self, tokens: list[int], keys: list[bytes], scopes: list[bytes], partial_scopes: tuple[bytes, ...],
              limit: int) -> Match:
        """Longest cached prefix of `tokens`, at most `limit` tokens long. keys[j] and scopes[j] belong to full
        block j; a partial hit may come from any scope in `partial_scopes`. Pure: the caller touches what it uses."""
        now, bs = self.clock(), self.bs
        nodes: list[Node] = []
        parent = self.roots.get(scopes[0]) if scopes else None
        for j, key in enumerate(keys):
            node = self.nodes.get(key)
            if (node is None or node.parent is not parent or node.expires_at <= now
                    or node.tokens != tuple(tokens[j * bs:(j + 1) * bs])):
                break
            nodes.append(node)
            parent = node
        result = Match(nodes)
        rest = tuple(tokens[len(nodes) * bs:(len(nodes) + 1) * bs])
        for p in [parent] if nodes else [self.roots.get(s) for s in partial_scopes]:
            for child in p.children.values() if p is not None else ():
                if child.scope in partial_scopes and child.expires_at > now:
                    n = _common(child.tokens, rest)
                    if n > result.partial_len:
                        result.partial, result.partial_len = child, n
        if len(result) > limit:  # the last prompt token is always computed, for its logits: cut to `limit` tokens
            whole = limit // bs
            if whole < len(result.nodes):  # the rest of the limit from the first block past it
                result.partial, result.partial_len = result.nodes[whole], limit - whole * bs
                del result.nodes[whole:]
            else:
                result.partial_len = limit - len(result.nodes) * bs
            if result.partial_len == 0:
                result.partial = None
        while not self.restores(result):  # cut back to a hit whose local layers' window is here
            if result.partial:
                result.partial, result.partial_len = None, 0
            else:
                first = self.pool.window_start(len(result))
                del result.nodes[max(j for j in range(first, len(result.nodes))
                                     if not self.pool.has_local(result.nodes[j].block)):]
        return result

    def restores(self, m: Match) -> bool:
        """Whether the local parts of every block a match's next token reads through the window are here."""
        if not self.pool.local_pages:
            return True
        used = m.nodes + [m.partial] if m.partial else m.nodes
        return all(self.pool.has_local(n.block) for n in used[self.pool.window_start(len(m)):])

    def insert(self, parent: Node | None, key: bytes, scope: bytes, tokens: tuple[int, ...], block: int,
               ttl: float | None, priority: int, owner: Hashable = None, adapter: str = "",
               output: bool = False) -> tuple[Node | None, bool]:
        """Publish a computed block (the cache takes its own reference). Returns (node, created); node is None
        on a hash collision, which is never resolved in favour of either side. `owner` owns the scope's entries,
        computed with `adapter`; `output`: the block holds output tokens (an answer, not only what a client sent)."""
        node = self.nodes.get(key)
        if node is not None and (node.tokens != tokens or node.parent is not parent and parent is not None):
            return None, False
        if node is not None:
            expired = node.expires_at <= self.clock()  # rewriting an expired entry is a new write
            node.ttl = ttl if expired else None if node.ttl is None or ttl is None else max(node.ttl, ttl)
            node.priority = max(node.priority, priority)
            self.touch([node])
            return node, expired
        if parent is None:
            parent = self.roots.setdefault(scope, Node(scope, None, scope, (), 0))
        assert parent.alive, "insert under an evicted node"
        node = Node(key, parent, scope, tokens, block, ttl=ttl, priority=priority, output=output,
                    content=block_key(parent.content, b"", np.asarray(tokens, dtype=np.int32).tobytes()))
        self.misses.stored(key, node.content)
        entry = self.scopes.setdefault(scope, [owner, 0, adapter, 0])
        entry[1] += 1
        entry[3] += 1
        self.pool.ref(block)
        if self.pool.has_local(block):
            self.pool.ref_local(block)
            node.local = True
            entry[3] += self.pool.local_pages
        parent.children[key] = node
        self.nodes[key] = node
        self.touch([node])
        if len(tokens) == self.bs:
            for listener in self.listeners:
                listener.stored(node)
        return node, True

    def get(self, key: bytes) -> Node | None:
        """The live node with this key, if any."""
        return self.nodes.get(key)

    def owner(self, node: Node) -> Hashable:
        return self.scopes[node.scope][0]

    def adapter(self, node: Node) -> str:
        return self.scopes[node.scope][2]

    def reuse(self, nodes: list[Node]) -> None:
        """A request's match is in use: count it on each of its blocks, and touch them."""
        for n in nodes:
            n.hits += 1
        self.touch(nodes)

    def top(self, n: int) -> list[tuple[Hashable, Node, int]]:
        """The n cached prefixes that saved the most prefill: (owner, its last block, tokens) (cache/node.py)."""
        return [(self.owner(v), v, tokens) for v, tokens in most_saved(self.nodes.values(), n)]

    def pages_by_owner(self) -> Counter:
        held: Counter = Counter()
        for owner, _, _, pages in self.scopes.values():
            held[owner] += pages
        return held

    def touch(self, nodes: list[Node]) -> None:
        now = self.clock()
        for n in nodes:
            n.last_access = now
            n.expires_at = now + n.ttl if n.ttl is not None else float("inf")

    def set_shares(self, shares: dict[Hashable, float], group: Callable[[Hashable], Hashable]) -> None:
        """Guaranteed fractions of the pool by owner group (`group` maps an owner to its group; the engine: its
        tenant). Groups without a share split what the shares leave, equally. Eviction takes from the group
        furthest over its guarantee, so a group under it loses nothing while another is over its own."""
        assert sum(shares.values()) <= 1 + 1e-9, "cache shares add up to more than the whole cache"
        self.shares, self.group = dict(shares), group

    def evict(self, n_pages: int, using: Counter | None = None, asking: Hashable | None = None) -> int:
        """Free up to n_pages by dropping evictable leaves and local parts, in the order of cache/eviction.py;
        returns how many pages were freed. `using`: pages each owner holds outside the cache (running sequences'),
        which count towards its group's share; for an owner `asking` for room, no other group at or under its share
        loses an unexpired entry."""
        return evict(self, n_pages, using, asking)

    def purge(self, scope: bytes) -> int:
        """Drop every unreferenced entry of one scope. Returns blocks freed."""
        return self._purge({scope})

    def purge_owner(self, owner: Hashable) -> int:
        """Drop every unreferenced entry of every scope `owner` owns. Returns blocks freed."""
        return self._purge({key for key, (o, _, _, _) in self.scopes.items() if o == owner})

    def explain(self, key: bytes) -> str | None:
        """Why the block with this key is not matchable: "expired", "evicted" (or purged), or None if unknown."""
        node = self.nodes.get(key)
        if node is not None and node.expires_at <= self.clock():
            return "expired"
        return self.misses.reason(key)

    def holds(self, tokens: list[int]) -> bool:
        """True if any scope holds a full-block path of exactly these tokens (len a multiple of block_size)."""
        return self.misses.holds(tokens, self.bs)

    def _purge(self, scopes: set[bytes] | None, reason: str = "purge") -> int:
        """Drop every unreferenced entry of these scopes (None: of all)."""
        freed = 0
        for node in sorted(self.nodes.values(), key=_depth, reverse=True):
            if (scopes is None or node.scope in scopes) and not node.children and self.pool.refs[node.block] == 1:
                self.remove(node, reason)
                freed += 1
        return freed

    def clear(self) -> int:
        """Drop every unreferenced entry. Returns blocks freed."""
        return self._purge(None, "clear")

    def pin(self, nodes: list[Node], pinned: bool = True) -> None:
        for n in nodes:
            self.num_pinned += pinned - n.pinned
            n.pinned = pinned

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)

    @property
    def num_local(self) -> int:
        """Nodes that hold their block's local part."""
        return sum(n.local for n in self.nodes.values())

    def evictable_blocks(self) -> int:
        return sum(1 for n in self.nodes.values() if not n.pinned and self.pool.refs[n.block] == 1)

    @property
    def num_scopes(self) -> int:
        return len(self.scopes)

    # ---- for eviction (cache/eviction.py) and the tiers ---------------------------------------------------
    def evictable(self, node: Node) -> bool:
        return node.alive and not node.children and not node.pinned and self.pool.refs[node.block] == 1

    def local_evictable(self, node: Node) -> bool:
        return node.alive and node.local and not node.pinned and self.pool.local_refs[node.block] == 1

    def attach_local(self, node: Node) -> None:
        """Give a node whose local part was evicted a new one (the caller fills it: engine/tiering.py)."""
        assert not node.local and node.alive
        self.pool.add_local(node.block)
        node.local = True
        self.scopes[node.scope][3] += self.pool.local_pages

    def drop_local(self, node: Node) -> int:
        node.local = False
        self.scopes[node.scope][3] -= self.pool.local_pages
        self.pool.unref_local(node.block)
        return self.pool.local_pages

    def remove(self, node: Node, reason: str) -> int:
        assert not node.children and node.alive
        if len(node.tokens) == self.bs:
            for listener in self.listeners:
                listener.removed(node, reason)
        node.alive = False
        self.num_pinned -= node.pinned
        del node.parent.children[node.key]
        del self.nodes[node.key]
        if not node.parent.children and node.parent.parent is None:
            del self.roots[node.parent.key]
        self.evictions[reason] += 1
        self.misses.removed(node.key, node.content, reason)
        freed = self.drop_local(node) if node.local else 0
        entry = self.scopes[node.scope]
        entry[1] -= 1
        entry[3] -= 1
        if not entry[1]:
            assert not entry[3], "a scope without nodes counts pages"
            del self.scopes[node.scope]
        self.pool.unref(node.block)
        return 1 + freed


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _depth(node: Node) -> int:
    d = 0
    while node.parent is not None:
        node, d = node.parent, d + 1
    return d
