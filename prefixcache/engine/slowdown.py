"""How much one tenant's rows may slow another's tokens (`tenant_slowdown`; DESIGN.md, invariant 8).

Every sequence in a step waits for the whole step, and on a CPU a decode row costs a good part of one: a tenant
streaming one answer beside another tenant's fifteen waits, per token, for sixteen rows, several times its step
alone. So while several tenants have work (engine/scheduler.py: running, waiting, or a request just finished, as a
client sending one after another has), a step may take at most `slowdown` times what it would with only one
tenant's decode rows (beside the prompt chunks it carries), for each of them, or, where that is longer, what it would
if no tenant had more decode rows than that one (by weight, their cache shares): tenants sharing the machine
equally pay what sharing costs, and rows beyond an equal part come only within the bound. A tenant with no decode
row in the step still waits for it (for its next first token) and counts with none. A step over the bound loses
decode rows of the tenant with the most by weight, the ones that ran most recently first (so that its sequences take
turns), until it holds; a tenant keeps at least one. Prompt chunks are never held back here (`shared_chunk` bounds
those), nor is a tenant alone in the engine. Costs are the step cost's predictions (engine/step_cost.py).
"""
import math
from collections import Counter

from prefixcache.cache.shares import guarantees
from prefixcache.engine.sequence import Sequence
from prefixcache.engine.step_cost import StepCost, Work

Plan = list[tuple[Sequence, int]]


def bounded(plan: Plan, cost: StepCost, shares: dict[str, float], slowdown: float, tenants: set[str]) -> Plan:
    """The plan without the decode rows that would slow another tenant's tokens past the bound (see the module), for
    `tenants`, those with work."""
    rows: dict[str, list[Sequence]] = {t: [] for t in tenants}  # decode rows by tenant, least recently run first
    for seq, _ in sorted(plan, key=lambda p: p[0].ran_at):
        if seq.num_uncomputed == 1:
            rows.setdefault(seq.scope.tenant, []).append(seq)
    if len(rows) < 2 or slowdown == math.inf:
        return plan
    prompts = sum((Work.chunk(seq.num_computed, n) for seq, n in plan if seq.num_uncomputed > 1), Work())
    weight = {t: max(w, 1e-9) for t, w in guarantees(Counter(dict.fromkeys(rows, 1)), shares, 1).items()}
    while True:
        work = {t: sum((Work.chunk(seq.num_computed, 1) for seq in r), Work()) for t, r in rows.items()}
        step = cost.seconds(prompts + sum(work.values(), Work()))
        bound = min(max(slowdown * cost.seconds(prompts + work[t]), cost.seconds(prompts + _equal(work, weight, t)))
                    for t in rows)
        heavy = max(rows, key=lambda t: len(rows[t]) / weight[t])
        if step <= bound or len(rows[heavy]) <= 1:
            break
        rows[heavy].pop()
    kept = {seq.id for r in rows.values() for seq in r}
    return [(seq, n) for seq, n in plan if seq.num_uncomputed > 1 or seq.id in kept]


def _equal(work: dict[str, Work], weight: dict[str, float], t: str) -> Work:
    """The decode rows if no tenant had more by weight than t (their keys in proportion)."""
    total = Work()
    for u, w in work.items():
        cap = max(1, round(work[t].rows * weight[u] / weight[t]))
        total += w if w.rows <= cap else Work(cap, w.keys * cap // w.rows)
    return total
