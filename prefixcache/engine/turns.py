"""The order in which waiting requests are admitted (engine/scheduler.py). A request passed over `fairness_steps`
times is due, and goes first, unless its tenant holds its part of the slots while another tenant waits below its own
(then its requests are passed over by design, and waiting earns them nothing); then weighted round-robin over tenants
(a request's turn: its tenant's running slots plus the tenant's requests waiting ahead of it, over the tenant's part
of the slots), so one tenant's flood of requests cannot starve another's; then the longest cached prefix, then
arrival. With a TTFT objective, a tenant's requests that can no longer meet it queue behind its others, and are not
due while one of its others can still meet it: past capacity the late ones, due in turn, went first, and made every
request after them late too (multi-tenant at 6.5 req/s, past capacity: 0.16-0.24 met both objectives, 0.54-0.66
with this).
"""
from collections.abc import Sequence as List

from prefixcache.cache.node import Match
from prefixcache.cache.shares import guarantees
from prefixcache.engine.sequence import Sequence
from prefixcache.engine.slot_shares import held


def turns(ready: List[tuple[Sequence, Match]], late: set[int], running: list[Sequence], shares: dict[str, float],
          max_num_seqs: int, fairness_steps: int) -> list[tuple[Sequence, Match, bool]]:
    """(request, its cache match, whether it is due), in admission order; `ready`: the requests that can be admitted,
    in arrival order; `late`: those that can no longer meet their first token's objective."""
    ready.sort(key=lambda p: p[0].id in late)  # stable: arrival
    fresh = {seq.scope.tenant for seq, _ in ready if seq.id not in late}
    turn = held(running)
    for seq, _ in ready:
        turn[seq.scope.tenant] += 0
    fair = guarantees(turn, shares, max_num_seqs)
    order = []
    for seq, m in ready:
        part = max(fair[seq.scope.tenant], 1e-9)  # a tenant without a share when the shares take all: last
        order.append((seq, m, turn[seq.scope.tenant] / part))
        turn[seq.scope.tenant] += 1 + len(seq.forks)
    under = {seq.scope.tenant for seq, _, t in order if t < 1}
    order = [(seq, m, t, seq.skipped >= fairness_steps and (t < 1 or not under - {seq.scope.tenant})
              and not (seq.id in late and seq.scope.tenant in fresh)) for seq, m, t in order]
    order.sort(key=lambda p: (not p[3], p[2], -len(p[1]), p[0].arrival))
    return [(seq, m, due) for seq, m, _, due in order]

