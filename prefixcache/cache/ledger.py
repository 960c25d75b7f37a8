"""Which blocks a tier holds: an index under a byte budget, least recently used first, each entry with an expiry.

L2 (disk.py) keeps its files' index here, and the capacity planner (bench/plan_tiers.py) models L2 and L3 with it
alone, no bytes stored. Times are passed in, so that the planner runs on its log's clock.
"""
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Entry:
    owner: str
    size: int
    expires_at: float


class Ledger:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # key hex -> entry, least recently used first
        self.bytes = 0

    def get(self, owner: str, key: str, now: float) -> Entry | None:
        """The live entry of this owner (now most recently used), or None; an expired one is forgotten first."""
        e = self.entries.get(key)
        if e is None or e.owner != owner:
            return None
        if e.expires_at <= now:
            self.forget(key)
            return None
        self.entries.move_to_end(key)
        return e

    def room(self, size: int) -> list[tuple[str, Entry]]:
        """Forget the least recently used entries until `size` more bytes fit; returns them."""
        out = []
        while self.entries and self.bytes + size > self.budget:
            key = next(iter(self.entries))
            out.append((key, self.forget(key)))
        return out

    def add(self, owner: str, key: str, size: int, ttl: float | None, now: float) -> None:
        assert key not in self.entries and size <= self.budget
        self.entries[key] = Entry(owner, size, now + ttl if ttl is not None else float("inf"))
        self.bytes += size

    def forget(self, key: str) -> Entry:
        e = self.entries.pop(key)
        self.bytes -= e.size
        return e

    def forget_owner(self, owner: str | None) -> list[str]:
        """Forget every entry of one owner (None: everyone's); returns their keys."""
        gone = [k for k, e in self.entries.items() if owner is None or e.owner == owner]
        for k in gone:
            self.forget(k)
        return gone
