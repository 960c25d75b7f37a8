"""Principal: who a request comes from (an API key's or an identity token's tenant, labels and limits), and the
cache scope that follows from it."""
from dataclasses import dataclass

from prefixcache.cache.scope import LOCAL_TENANT, CacheScope


@dataclass(frozen=True)
class Principal:
    tenant: str
    labels: tuple[str, ...] = ()
    admin: bool = False
    rpm: float | None = None  # requests per minute; None: no limit
    tpm: float | None = None  # prompt tokens per minute; None: no limit
    cache_share: float | None = None  # tenant's guaranteed fraction of the KV cache; None: an equal part of the rest

    def scope(self, salt: str = "") -> CacheScope:
        """The cache scope of this caller's requests: its tenant and labels, narrowed by the client's salt."""
        return CacheScope(tenant=self.tenant, labels=self.labels, salt=salt)


LOCAL = Principal(LOCAL_TENANT, admin=True)
