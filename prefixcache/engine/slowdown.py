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
turns), until it holds; a tenant keeps at least one. A tenant alone in the engine is never held back.

Prompt chunks are held to the same bound, for each tenant with decode rows in the step (or with nothing in it that
has just finished a request: its next one runs in a lane step inside this one, and gets its second token only after
it), when they are of a tenant that has had more engine time lately than it (engine/usage.py): then they take at
most `slowdown` times that tenant's rows and chunks alone, or, where that is longer, as many tokens as it has rows
(by weight), the largest chunk cut first. Another tenant's 3,000-token prompts (512 tokens a step) took a stream's
inter-token p50 from 7 ms to 0.9 s; now to 18 ms (bench/results/abuse-issue57.md): what is left is the heavy
tenant's one token at a long context, whose step reads its whole KV, an equal part. A request of a tenant that has
had less is not cut (its first token is not made to wait for others' streams), nor are a tenant's own chunks beside
its own rows. Costs are the step cost's predictions (engine/step_cost.py).
"""
import math
from collections import Counter

from prefixcache.cache.shares import guarantees
from prefixcache.engine.sequence import Sequence
from prefixcache.engine.step_cost import StepCost, Work
from prefixcache.engine.usage import Usage

Plan = list[tuple[Sequence, int]]


def bounded(plan: Plan, cost: StepCost, shares: dict[str, float], slowdown: float, tenants: set[str],
            usage: Usage) -> Plan:
    """The plan without the decode rows, and with prompt chunks cut, that would slow another tenant's tokens past the
    bound (see the module), for `tenants`, those with work; `usage`: their engine time lately."""
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
    plan = [(seq, n) for seq, n in plan if seq.num_uncomputed > 1 or seq.id in kept]
    # a tenant between two requests, as if it had one row (its next may run in a lane step inside this one)
    between = {t: 1 for t in usage.finished if t in rows and not rows[t] and all(s.scope.tenant != t for s, _ in plan)}
    return _chunks(plan, cost, weight, slowdown, {**between, **{t: len(r) for t, r in rows.items() if r}},
                   usage.tokens)


def _chunks(plan: Plan, cost: StepCost, weight: dict[str, float], slowdown: float, decoding: dict[str, int],
            usage: dict[str, float]) -> Plan:
    """The plan with the prompt chunks cut that slow a tenant in `decoding` (by its decode rows) past the bound: of
    tenants that have had more engine time lately, the largest (by weight) first, each to no fewer tokens than that
    tenant's rows by weight."""
    sizes = {seq.id: n for seq, n in plan}

    def work(skip: int | None = None, tenant: str | None = None) -> Work:
        return sum((Work.chunk(seq.num_computed, sizes[seq.id]) for seq, _ in plan
                    if seq.id != skip and tenant in (None, seq.scope.tenant)), Work())

    for t in sorted(decoding, key=lambda t: cost.seconds(work(tenant=t))):  # the tightest bound first
        limit = slowdown * cost.seconds(work(tenant=t))
        floor = {u: max(1, round(decoding[t] * weight[u] / weight[t])) for u in weight}
        while cost.seconds(work()) > limit:
            cut = [seq for seq, _ in plan if seq.num_uncomputed > 1 and sizes[seq.id] > floor[seq.scope.tenant]
                   and usage.get(seq.scope.tenant, 0.0) > usage.get(t, 0.0)]
            if not cut:
                break
            seq = max(cut, key=lambda s: sizes[s.id] / weight[s.scope.tenant])
            sizes[seq.id] = cost.most(work(skip=seq.id), seq.num_computed, sizes[seq.id], floor[seq.scope.tenant],
                                      limit)
    return [(seq, sizes[seq.id]) for seq, _ in plan]


def _equal(work: dict[str, Work], weight: dict[str, float], t: str) -> Work:
    """The decode rows if no tenant had more by weight than t (their keys in proportion)."""
    total = Work()
    for u, w in work.items():
        cap = max(1, round(work[t].rows * weight[u] / weight[t]))
        total += w if w.rows <= cap else Work(cap, w.keys * cap // w.rows)
    return total
