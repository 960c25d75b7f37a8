"""Eviction from the prefix cache (cache/radix.py): expired entries first, then from the owner group furthest over its
guaranteed share of the pool (cache/shares.py; without shares, an equal share, so the group holding the most); within
a group, lower priority, then least recently used, a node's local part before the node. A freed leaf's parent may
become the next victim.
"""
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Protocol

from prefixcache.cache.node import Listener, Node
from prefixcache.cache.pool import KVPool
from prefixcache.cache.shares import Victims


class Evictable(Protocol):
    """What eviction uses of the prefix cache (cache/radix.py), which calls it."""

    nodes: dict[bytes, Node]
    pool: KVPool
    bs: int
    listeners: list[Listener]
    shares: dict[Hashable, float]
    group: Callable[[Hashable], Hashable]
    clock: Callable[[], float]

    def owner(self, node: Node) -> Hashable: ...

    def pages_by_owner(self) -> Counter: ...

    def evictable(self, node: Node) -> bool: ...

    def local_evictable(self, node: Node) -> bool: ...

    def drop_local(self, node: Node) -> int: ...

    def remove(self, node: Node, reason: str) -> int: ...


def evict(cache: Evictable, n_pages: int, using: Counter | None, asking: Hashable | None) -> int:
    """PrefixCache.evict: free up to n_pages, in this module's order; for an owner `asking` for room, no other group
    at or under its share loses an unexpired entry (`using`: pages each owner holds outside the cache)."""
    now = cache.clock()
    ranks = [(cache.owner(n), _rank(n, now, whole=True)) for n in cache.nodes.values() if cache.evictable(n)]
    ranks += [(cache.owner(n), _rank(n, now, whole=False)) for n in cache.nodes.values() if cache.local_evictable(n)]
    victims = Victims(cache.pages_by_owner(), cache.shares, cache.group, cache.pool.usable_blocks, ranks, using,
                      asking)
    freed = 0
    while freed < n_pages and victims and (victim := victims.pop()) is not None:
        owner, rank = victim
        node, whole = rank[-1], rank[-3]
        if not whole:
            if cache.local_evictable(node):
                if len(node.tokens) == cache.bs:
                    for listener in cache.listeners:
                        listener.thinned(node)
                dropped = cache.drop_local(node)
                victims.took(owner, dropped)
                freed += dropped
            continue
        if not cache.evictable(node):
            continue
        parent = node.parent
        dropped = cache.remove(node, "ttl" if rank[0] == 0 else "capacity")
        victims.took(owner, dropped)
        freed += dropped
        if parent is not None and parent.parent is not None and cache.evictable(parent):
            victims.push(cache.owner(parent), _rank(parent, now, whole=True))
    return freed


def _rank(node: Node, now: float, whole: bool) -> tuple:
    """Eviction order within an owner: expired first (0), then lower priority, then least recently used; a local
    part (whole False) before its node."""
    return (0 if node.expires_at <= now else 1, node.priority, node.last_access, whole, id(node), node)
