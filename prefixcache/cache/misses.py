"""Miss bookkeeping: what the prefix cache remembers so that it can say why a block did not match.

It remembers the keys of recently removed blocks with the reason they went (a miss on one was "expired" or
"evicted", not "cold"), and counts the scope-free keys of live entries (whether any scope holds some tokens: for
the operator's log only, since telling a tenant would reveal what another tenant has cached).
"""
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from prefixcache.cache.keys import chain_keys

GONE_MEMORY = 100_000  # removed keys remembered to explain misses


@dataclass
class Misses:
    contents: Counter[bytes] = field(default_factory=Counter)  # scope-free keys of live entries
    gone: OrderedDict[bytes, str] = field(default_factory=OrderedDict)  # recently removed keys -> reason

    def stored(self, key: bytes, content: bytes) -> None:
        self.contents[content] += 1
        self.gone.pop(key, None)

    def removed(self, key: bytes, content: bytes, reason: str) -> None:
        self.contents[content] -= 1
        if not self.contents[content]:
            del self.contents[content]
        self.gone[key] = reason
        if len(self.gone) > GONE_MEMORY:
            self.gone.popitem(last=False)

    def reason(self, key: bytes) -> str | None:
        """Why a block with this key went lately: "expired" or "evicted" (or purged); None if unknown."""
        reason = self.gone.get(key)
        return None if reason is None else "expired" if reason == "ttl" else "evicted"

    def holds(self, tokens: list[int], block_size: int) -> bool:
        """True if any scope holds a full-block path of exactly these tokens (len a multiple of block_size)."""
        return chain_keys(tokens, [b""] * (len(tokens) // block_size), block_size)[-1] in self.contents
