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
it), when they are of a tenant that has had more engine time lately than it (engine/usage.py). Chunks that would take
the step past it are held back whole for HELD steps, then run in the slack those steps left (their own and HELD more
times `slowdown - 1` that tenant's work alone), but never fewer tokens than that tenant has rows (by weight): the
bound holds on average over the steps they waited, and the other tenant's tokens come at its own pace in the steps
between. A few tokens a step would hold the bound in each step, but pay in each the chunk's fixed costs (its KV read
to the end of its context, its part of the step's overhead) and give the lighter tenant a slower token every time:
another tenant's 3,000-token prompts (512 tokens a step) took a stream's inter-token p50 from 7 ms to 0.9 s, with a
few tokens of theirs in every step to 14.5 ms (1.69x), and held back to 1.21x (bench/results/abuse-issue57.md). A
request of a tenant that has had less is not cut (its first token is not made to wait for others' streams), nor are a
tenant's own chunks beside its own rows. Costs are the step cost's predictions (engine/step_cost.py).
"""
import math
from collections import Counter
from itertools import accumulate

from prefixcache.cache.shares import guarantees
from prefixcache.engine.sequence import Plan, Sequence
from prefixcache.engine.step_cost import StepCost, Work
from prefixcache.engine.usage import Usage

HELD = 4  # steps in a row a tenant's prompt chunks may be held back whole before they run at least its equal part


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
    prompts = sum((seq.work(n) for seq, n in plan if seq.num_uncomputed > 1), Work())
    weight = {t: max(w, 1e-9) for t, w in guarantees(Counter(dict.fromkeys(rows, 1)), shares, 1).items()}
    first = {t: list(accumulate((seq.work(1) for seq in r), initial=Work())) for t, r in rows.items()}  # [k]: k rows'
    count = {t: len(r) for t, r in rows.items()}
    while True:
        work = {t: first[t][k] for t, k in count.items()}
        step = cost.seconds(prompts + sum(work.values(), Work()))
        bound = min(max(slowdown * cost.seconds(prompts + work[t]), cost.seconds(prompts + _equal(work, weight, t)))
                    for t in rows)
        heavy = max(rows, key=lambda t: count[t] / weight[t])
        if step <= bound or count[heavy] <= 1:
            break
        count[heavy] -= 1
    rows = {t: r[:count[t]] for t, r in rows.items()}
    kept = {seq.id for r in rows.values() for seq in r}
    plan = [(seq, n) for seq, n in plan if seq.num_uncomputed > 1 or seq.id in kept]
    # a tenant between two requests, as if it had one row (its next may run in a lane step inside this one)
    between = {t: 1 for t in usage.finished if t in rows and not rows[t] and all(s.scope.tenant != t for s, _ in plan)}
    return _chunks(plan, cost, weight, slowdown, {**between, **{t: len(r) for t, r in rows.items() if r}}, usage)


def _chunks(plan: Plan, cost: StepCost, weight: dict[str, float], slowdown: float, decoding: dict[str, int],
            usage: Usage) -> Plan:
    """The plan with the prompt chunks held back that slow a tenant in `decoding` (by its decode rows) past the
    bound, of tenants that have had more engine time lately: the heaviest (by weight) first, each held whole for HELD
    steps (counted in `usage.held`), then cut to what HELD + 1 steps' slack allows, the largest chunk first, but to
    at least as many tokens in all as that tenant has rows (by weight)."""
    prompts = [seq for seq, _ in plan if seq.num_uncomputed > 1]
    if not prompts:
        return plan
    asked = {seq.id: n for seq, n in plan}
    sizes = dict(asked)
    chunks, ids = {seq.scope.tenant for seq in prompts}, {seq.id for seq in prompts}

    def work(tenant: str | None = None, without: str | None = None) -> Work:
        """The step's work, or a tenant's; `without`: a tenant's prompt chunks left out."""
        return sum((seq.work(sizes[seq.id]) for seq, _ in plan if tenant in (None, seq.scope.tenant)
                    and not (seq.scope.tenant == without and seq.id in ids)), Work())

    def tokens(u: str) -> int:
        return sum(sizes[seq.id] for seq in prompts if seq.scope.tenant == u)

    for t in sorted(decoding, key=lambda t: cost.seconds(work(t))):  # the tightest bound first
        bound = slowdown * cost.seconds(work(t))
        heavier = [u for u in chunks if usage.tokens.get(u, 0.0) > usage.tokens.get(t, 0.0)]
        for u in sorted(heavier, key=lambda u: tokens(u) / weight[u], reverse=True):
            if cost.seconds(work()) <= bound:
                break
            own = sorted((seq for seq in prompts if seq.scope.tenant == u), key=lambda s: sizes[s.id], reverse=True)
            if usage.held.get(u, 0) < HELD:
                for seq in own:
                    sizes[seq.id] = 0
                continue
            limit = bound + HELD * max(0.0, bound - cost.seconds(work(without=u)))
            for seq in own:
                n, sizes[seq.id] = sizes[seq.id], 0
                sizes[seq.id] = cost.most(work(), seq.work, n, 0, limit)
            floor = max(1, round(decoding[t] * weight[u] / weight[t]))
            for seq in own[::-1]:  # the smallest first: a chunk's cost grows with its prompt's context too
                sizes[seq.id] += min(asked[seq.id] - sizes[seq.id], max(0, floor - tokens(u)))
    for u in chunks:
        usage.held[u] = usage.held.get(u, 0) + 1 if tokens(u) == 0 else 0
    return [(seq, sizes[seq.id]) for seq, _ in plan if sizes[seq.id]]


def _equal(work: dict[str, Work], weight: dict[str, float], t: str) -> Work:
    """The decode rows if no tenant had more by weight than t (their keys in proportion)."""
    total = Work()
    for u, w in work.items():
        cap = max(1, round(work[t].rows * weight[u] / weight[t]))
        total += w if w.rows <= cap else Work(cap, w.keys * cap // w.rows, w.heads * cap // w.rows)
    return total
