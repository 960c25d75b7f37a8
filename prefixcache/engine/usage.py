"""Each tenant's engine use lately, and which tenants have work: what the prefill shares (Scheduler._prefill_shares)
and the slowdown bound (engine/slowdown.py) go by."""
import time

from prefixcache.engine.sequence import Plan, Sequence

USAGE_HALF_LIFE = 2.0  # seconds: how fast a tenant's engine use is forgotten (Usage.charge)
NEXT_REQUEST = 0.1  # seconds a tenant still counts as having work after its last request finished: the gap of a
# client that sends one request after another, not of one that sends a request now and then


class Usage:
    def __init__(self):
        self.tokens: dict[str, float] = {}  # tenant -> tokens computed, halved every USAGE_HALF_LIFE
        self.charged_at = time.monotonic()
        self.finished: dict[str, float] = {}  # tenant -> when its last request finished (monotonic)
        self.held: dict[str, int] = {}  # tenant -> steps in a row its prompt chunks were held back whole (slowdown.py)

    def charge(self, plan: Plan) -> None:
        """Charge a step to its tenants: the tokens each computed in it, a measure of engine time that does not
        depend on the machine's noise (nor tell a tenant anything through it); older charges fade."""
        now = time.monotonic()
        fade, self.charged_at = 0.5 ** ((now - self.charged_at) / USAGE_HALF_LIFE), now
        self.tokens = {t: u * fade for t, u in self.tokens.items() if u * fade > 1e-3}
        for seq, n in plan:
            self.tokens[seq.scope.tenant] = self.tokens.get(seq.scope.tenant, 0.0) + n

    def finish(self, tenant: str) -> None:
        self.finished[tenant] = time.monotonic()

    def tenants(self, running: list[Sequence], waiting) -> set[str]:
        """The tenants with work: running or waiting, or finished within NEXT_REQUEST."""
        now = time.monotonic()
        self.finished = {t: at for t, at in self.finished.items() if now - at < NEXT_REQUEST}
        return {s.scope.tenant for s in running} | {s.scope.tenant for s in waiting} | set(self.finished)

    def least(self, tenants: set[str]) -> str | None:
        """The one of two or more tenants with the least use lately; None on a tie."""
        first, second = sorted(tenants, key=lambda t: self.tokens.get(t, 0.0))[:2]
        return None if self.tokens.get(first, 0.0) == self.tokens.get(second, 0.0) else first
