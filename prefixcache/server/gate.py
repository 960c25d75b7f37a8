"""The admission gate: requests in flight (running or queued in the engine) per tenant, against the server's
capacity (`max_num_seqs + max_queue`), shared by weight.

Below capacity any request enters. At capacity only a tenant below its fair part of the capacity enters: its
`cache_share` of it, or an equal part of what the shares leave, among the tenants with requests in flight and itself.
So a tenant that holds every slot gets the 429 while a newcomer still enters, and the engine's scheduler then gives
the newcomer its share of the running slots. In flight stays below twice the capacity.
"""
from collections import Counter

from prefixcache.cache.shares import guarantees


def admits(held: Counter, tenant: str, shares: dict[str, float], capacity: int) -> bool:
    """Whether a new request of `tenant` may enter, with `held` requests in flight by tenant."""
    if sum(held.values()) < capacity:
        return True
    fair = guarantees(Counter({**held, tenant: held[tenant]}), shares, capacity)
    return held[tenant] + 1 <= fair[tenant]
