"""NullCache: the prefix cache when caching is off. Nothing matches, nothing is kept, no listener is ever told."""
from collections import Counter
from collections.abc import Callable, Hashable

from prefixcache.cache.node import Listener, Match, Node


class NullCache:
    enabled = False
    num_blocks = num_pinned = num_scopes = num_local = 0
    evictions: Counter[str] = Counter()

    def __init__(self):
        self.listeners: list[Listener] = []

    def match(self, tokens: list[int], keys: list[bytes], scopes: list[bytes], partial_scopes: tuple[bytes, ...],
              limit: int) -> Match:
        return Match([])

    def attach_local(self, node: Node) -> None:
        raise KeyError(node.scope)  # no node is ever this cache's

    def restores(self, m: Match) -> bool:
        return True

    def insert(self, parent: Node | None, key: bytes, scope: bytes, tokens: tuple[int, ...], block: int,
               ttl: float | None, priority: int, owner: Hashable = None, adapter: str = "",
               output: bool = False) -> tuple[None, bool]:
        return None, False

    def get(self, key: bytes) -> None:
        return None

    def owner(self, node: Node) -> Hashable:
        raise KeyError(node.scope)  # no node is ever this cache's

    def adapter(self, node: Node) -> str:
        raise KeyError(node.scope)

    def reuse(self, nodes: list[Node]) -> None:
        pass

    def pin(self, nodes: list[Node], pinned: bool = True) -> None:
        pass

    def evict(self, n_pages: int, using: Counter | None = None, asking: Hashable | None = None) -> int:
        return 0

    def set_shares(self, shares: dict[Hashable, float], group: Callable[[Hashable], Hashable]) -> None:
        pass

    def purge(self, scope: bytes) -> int:
        return 0

    def purge_owner(self, owner: Hashable) -> int:
        return 0

    def clear(self) -> int:
        return 0

    def explain(self, key: bytes) -> None:
        return None

    def holds(self, tokens: list[int]) -> bool:
        return False

    def top(self, n: int) -> list:
        return []

    def pages_by_owner(self) -> Counter:
        return Counter()

    def evictable_blocks(self) -> int:
        return 0
