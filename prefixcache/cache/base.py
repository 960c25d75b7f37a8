"""Cache: the interface the engine holds its prefix cache by. PrefixCache (cache/radix.py) and NullCache
(cache/null.py, caching off) both meet it; it lists what the engine and the capacity planner use, and no more.
"""
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Protocol

from prefixcache.cache.node import Listener, Match, Node


class Cache(Protocol):
    """KV blocks cached by scope key and tokens: looked up, published, evicted and purged. It knows scope keys,
    tokens, block ids and opaque owners, never a request."""

    def match(self, tokens: list[int], keys: list[bytes], scopes: list[bytes], partial_scopes: tuple[bytes, ...],
              limit: int) -> Match:
        """The longest cached prefix of `tokens`, at most `limit` tokens long (keys[j], scopes[j]: full block j)."""

    def attach_local(self, node: Node) -> None:
        """Give a node whose local part was evicted a new one, for the caller to fill."""

    def restores(self, m: Match) -> bool:
        """Whether a match can still be served: the local parts its window reads are here (cache/pool.py)."""

    def insert(self, parent: Node | None, key: bytes, scope: bytes, tokens: tuple[int, ...], block: int,
               ttl: float | None, priority: int, owner: Hashable = None, adapter: str = "",
               output: bool = False) -> tuple[Node | None, bool]:
        """Publish a computed block under `parent`: (its node, whether created); no node on a hash collision."""

    def get(self, key: bytes) -> Node | None:
        """The live node with this key, if any."""

    def owner(self, node: Node) -> Hashable:
        """Whose a cached block is: its scope's owner."""

    def adapter(self, node: Node) -> str:
        """The LoRA adapter a cached block was computed with (its scope's `adapter` field; "" for none)."""

    def reuse(self, nodes: list[Node]) -> None:
        """A request's match is in use: count it on each of its blocks, and touch them."""

    def pin(self, nodes: list[Node], pinned: bool = True) -> None:
        """Keep these blocks from eviction, or (pinned False) let them go again."""

    def evict(self, n_pages: int, using: Counter | None = None, asking: Hashable | None = None) -> int:
        """Free up to n_pages of unreferenced entries and local parts; returns how many pages were freed. `using`:
        the pages each owner holds outside the cache, counted towards its group's share; for an owner `asking` for
        room, no other group at or under its share loses an unexpired entry."""

    def set_shares(self, shares: dict[Hashable, float], group: Callable[[Hashable], Hashable]) -> None:
        """Guaranteed fractions of the pool by owner group (`group`: an owner's group), weighed by eviction."""

    def purge(self, scope: bytes) -> int:
        """Drop every unreferenced entry of one scope; returns blocks freed."""

    def purge_owner(self, owner: Hashable) -> int:
        """Drop every unreferenced entry of every scope `owner` owns; returns blocks freed."""

    def clear(self) -> int:
        """Drop every unreferenced entry; returns blocks freed."""

    def explain(self, key: bytes) -> str | None:
        """Why the block with this key is not matchable: "expired", "evicted", or None if unknown."""

    def holds(self, tokens: list[int]) -> bool:
        """True if any scope holds a full-block path of exactly these tokens."""

    def top(self, n: int) -> list[tuple[Hashable, Node, int]]:
        """The n cached prefixes that saved the most prefill: (owner, its last block, tokens)."""

    def pages_by_owner(self) -> Counter:
        """Cached pages by owner: a block's page, and its local part's pages while it has one (cache/pool.py)."""

    def evictable_blocks(self) -> int:
        """Cached blocks that nothing but the cache references and nothing pins."""

    @property
    def num_blocks(self) -> int:
        """Cached blocks."""

    @property
    def num_scopes(self) -> int:
        """Scopes with cached blocks."""

    @property
    def num_local(self) -> int:
        """Cached blocks that hold their local part (cache/pool.py)."""

    enabled: bool  # False for NullCache: nothing is matched or kept
    num_pinned: int  # blocks that eviction may never take
    evictions: Counter[str]  # entries removed, by reason ("capacity", "ttl", "purge", "clear")
    listeners: list[Listener]  # told of every full block that enters or leaves
