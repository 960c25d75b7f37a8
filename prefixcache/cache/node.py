"""The prefix cache's entries, as every cache (cache/base.py), its users and its listeners see them: Node (one
cached block, a node of the tree), Match (a cached prefix of a request) and Listener (told of full blocks entering
and leaving the cache), and the prefixes that saved the most (most_saved).
"""
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(eq=False)
class Node:
    key: bytes
    parent: "Node | None"
    scope: bytes
    tokens: tuple[int, ...]
    block: int
    local: bool = False  # the cache holds the block's local part too (cache/pool.py)
    output: bool = False  # holds output tokens: KV events never carry its tokens (cache/zmq_events.py)
    content: bytes = b""  # the key this block would have with no scope at all (for "scope differs" answers)
    children: dict[bytes, "Node"] = field(default_factory=dict)
    last_access: float = 0.0
    ttl: float | None = None
    expires_at: float = float("inf")
    priority: int = 0
    pinned: bool = False
    alive: bool = True
    hits: int = 0  # requests that reused this block


@dataclass
class Match:
    nodes: list[Node]  # full blocks, used in place
    partial: Node | None = None  # copied from: its first `partial_len` tokens
    partial_len: int = 0

    def __len__(self) -> int:
        return sum(len(n.tokens) for n in self.nodes) + self.partial_len


class Listener(Protocol):
    def stored(self, node: Node) -> None: ...

    def removed(self, node: Node, reason: str) -> None: ...

    def thinned(self, node: Node) -> None:
        """A full block's local part (cache/pool.py) is evicted for room, the block staying (its K/V still held)."""


def most_saved(nodes: Iterable[Node], n: int) -> list[tuple[Node, int]]:
    """The n cached prefixes that saved the most prefill: (its last block, tokens), by hits x tokens. A prefix counts
    where its reuse ends: at a block reused more often than any of its children."""
    depth: dict[bytes, int] = {}

    def tokens(v: Node) -> int:  # the prefix's length, memoized up the chain
        chain = []
        while v.tokens and v.key not in depth:
            chain.append(v)
            v = v.parent
        total = depth.get(v.key, 0) if v.tokens else 0
        for u in reversed(chain):
            total = depth[u.key] = total + len(u.tokens)
        return total

    ends = (v for v in nodes if v.hits > max((c.hits for c in v.children.values()), default=0))
    return [(v, depth[v.key]) for v in heapq.nlargest(n, ends, key=lambda v: v.hits * tokens(v))]
