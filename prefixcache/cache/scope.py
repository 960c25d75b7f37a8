"""CacheScope: everything that changes a prefix's meaning or who may read it. Its hash roots every cache key."""
from dataclasses import dataclass, replace
from functools import cached_property

import xxhash

SHARED_TENANT = "*shared*"
LOCAL_TENANT = "local"  # the one tenant of a server without API keys
PUBLIC_OWNERS = {(SHARED_TENANT, ()), (LOCAL_TENANT, ())}  # owners whose entries any request of the server may read


@dataclass(frozen=True)
class CacheScope:
    tenant: str = LOCAL_TENANT
    labels: tuple[str, ...] = ()  # permission set, security tier, ...
    fingerprint: str = ""  # the weights and the arithmetic that runs them (Engine.fingerprint); the engine fills it in
    adapter: str = ""
    tool_config: str = ""  # hash of the tool definitions
    policy: str = ""  # policy or template version
    salt: str = ""  # client-supplied: only ever narrows a scope

    def __post_init__(self):
        object.__setattr__(self, "labels", tuple(sorted(set(self.labels))))

    @cached_property
    def key(self) -> bytes:
        fields = (self.tenant, ",".join(self.labels), self.fingerprint, self.adapter, self.tool_config, self.policy,
                  self.salt)
        return xxhash.xxh3_128_digest("\x1f".join(f"{len(f)}:{f}" for f in fields).encode())

    @property
    def owner(self) -> tuple[str, tuple[str, ...]]:
        """Whose entries a scope's are, for purges: its tenant and labels, whatever the salt or other fields."""
        return self.tenant, self.labels

    @cached_property
    def shared(self) -> "CacheScope":
        """The operator-declared scope shared across tenants, labels and salts (never across weights)."""
        return replace(self, tenant=SHARED_TENANT, labels=(), salt="")
