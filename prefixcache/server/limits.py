"""Per-tenant rate limits: requests and prompt tokens per minute (`rpm`, `tpm`), a tenant's whatever key or
identity token it comes with (server/auth.py and server/oidc.py resolve them per tenant).

Each limit is a token bucket that holds a minute's worth and refills continuously. Every authenticated request takes
one request when it arrives, before its body is read further (so requests refused for their body, and the token and
render routes, are charged too); its prompt tokens are taken once they are counted, before the engine sees it. A take
larger than a minute's worth passes when the bucket is full and leaves it in debt. A take that does not fit is
refused with 429 and the seconds until it would fit (`Retry-After`); it takes nothing. A changed limit (a reloaded
keys file) keeps the bucket's level, capped at the new limit: it never refills a bucket.
"""
import math
import time
from dataclasses import dataclass, field


@dataclass
class Bucket:
    per_minute: float
    level: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.level = self.per_minute

    def wait(self, n: float, now: float) -> float:
        """Seconds until n can be taken (0: now), after refilling to `now`."""
        self.level = min(self.per_minute, self.level + max(0.0, now - self.stamp) * self.per_minute / 60)
        self.stamp = max(self.stamp, now)
        return max(0.0, min(n, self.per_minute) - self.level) * 60 / self.per_minute


class RateLimits:
    def __init__(self):
        self.buckets: dict[tuple[str, str], Bucket] = {}  # (tenant, "requests" | "tokens")

    def take(self, tenant: str, kind: str, limit: float | None, n: int) -> int:
        """Take n from the tenant's bucket of this kind (no limit: nothing to take); or, if n does not fit, take
        nothing and return the whole seconds to wait (0 means taken)."""
        if not limit:
            return 0
        b = self.buckets.get((tenant, kind))
        if b is None:
            b = self.buckets[(tenant, kind)] = Bucket(limit)
        elif b.per_minute != limit:
            b.per_minute, b.level = limit, min(b.level, limit)
        wait = b.wait(n, time.monotonic())
        if wait > 0:
            return max(1, math.ceil(wait))
        b.level -= n
        return 0
