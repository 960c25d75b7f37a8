"""One step's prefill tokens by tenant under `shared_chunk` (Scheduler._prefill_shares decides the cap and whom it
exempts)."""
from collections import Counter

from prefixcache.engine.sequence import Sequence


class PrefillShares:
    """One step's prefill tokens by tenant, each tenant's capped at `cap` (None: no cap) except the `exempt` one's.
    Decode rows (a sequence's one uncomputed token) are never capped."""

    def __init__(self, cap: int | None, exempt: str | None = None):
        self.cap, self.exempt, self.used = cap, exempt, Counter()

    def allow(self, seq: Sequence, n: int) -> int:
        if self.cap is None or seq.num_uncomputed == 1 or seq.scope.tenant == self.exempt:
            return n
        return max(0, min(n, self.cap - self.used[seq.scope.tenant]))

    def take(self, seq: Sequence, n: int) -> None:
        if seq.num_uncomputed > 1 or n > 1:
            self.used[seq.scope.tenant] += n
