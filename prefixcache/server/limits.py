"""Per-tenant rate limits: requests and prompt tokens per minute, from the API key's entry (`rpm`, `tpm`).

Each limit is a token bucket that holds a minute's worth and refills continuously. A request takes one request
and its prompt tokens; a prompt larger than a minute's worth passes when the bucket is full and leaves it in
debt. A request that does not fit is refused with 429 and the seconds until it would fit (`Retry-After`); it
takes nothing.
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

    def admit(self, tenant: str, rpm: float | None, tpm: float | None, prompt_tokens: int) -> int:
        """Take one request and its prompt tokens from the tenant's buckets; or, if they do not fit, take nothing
        and return the whole seconds to wait (0 means admitted)."""
        now = time.monotonic()
        wanted = [(self._bucket(tenant, kind, limit), n) for kind, limit, n in
                  (("requests", rpm, 1), ("tokens", tpm, prompt_tokens)) if limit]
        wait = max((b.wait(n, now) for b, n in wanted), default=0.0)
        if wait > 0:
            return max(1, math.ceil(wait))
        for b, n in wanted:
            b.level -= n
        return 0

    def _bucket(self, tenant: str, kind: str, limit: float) -> Bucket:
        b = self.buckets.get((tenant, kind))
        if b is None or b.per_minute != limit:  # new, or the keys file changed the limit
            b = self.buckets[(tenant, kind)] = Bucket(limit)
        return b
