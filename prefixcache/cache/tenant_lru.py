"""TenantLru: what the engine keeps per cache scope beside the KV (compiled grammars, answer tables), bounded per
tenant and in all.

A tenant has as many scopes as it has label sets and salts (an identity token's groups make label sets at will), so
a bound per owner bounds nothing. Here a tenant keeps at most `per_tenant` values, its least recently used out first,
and the server `total`: past that, the tenant holding the most gives up its least recently used one, so no tenant
takes another's below an equal part.
"""
from collections import Counter, OrderedDict
from typing import Callable, Generic, TypeVar

from prefixcache.cache.scope import CacheScope

V = TypeVar("V")


class TenantLru(Generic[V]):
    def __init__(self, per_tenant: int, total: int):
        self.per_tenant, self.total = per_tenant, total
        self.items: OrderedDict[bytes, tuple[tuple, V]] = OrderedDict()  # scope key -> (owner, value)

    def get(self, scope: CacheScope) -> V | None:
        """The scope's value (now its tenant's most recently used), if kept."""
        if (item := self.items.get(scope.key)) is None:
            return None
        self.items.move_to_end(scope.key)
        return item[1]

    def setdefault(self, scope: CacheScope, make: Callable[[], V]) -> V:
        """The scope's value, made if none is kept."""
        if (value := self.get(scope)) is None:
            value = self.put(scope, make())
        return value

    def put(self, scope: CacheScope, value: V) -> V:
        self.items[scope.key] = (scope.owner, value)
        self.items.move_to_end(scope.key)
        held = self.held()
        while held[scope.tenant] > self.per_tenant:
            self._drop_oldest(scope.tenant, held)
        while len(self.items) > self.total:
            self._drop_oldest(max(held, key=held.get), held)
        return value

    def held(self) -> Counter[str]:
        """Values kept, by tenant."""
        return Counter(owner[0] for owner, _ in self.items.values())

    def purge(self, owner: tuple) -> None:
        """Drop an owner's (tenant and labels) values, under every salt."""
        for key in [k for k, (o, _) in self.items.items() if o == owner]:
            del self.items[key]

    def clear(self) -> None:
        self.items.clear()

    def _drop_oldest(self, tenant: str, held: Counter) -> None:
        del self.items[next(k for k, (owner, _) in self.items.items() if owner[0] == tenant)]
        held[tenant] -= 1
