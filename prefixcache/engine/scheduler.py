"""Continuous batching: which sequences run this step, and how many of their tokens.

The running slots (`max_num_seqs`) are shared by tenant weight (engine/slot_shares.py): a tenant with a request
waiting and fewer slots than its part takes them from the tenant furthest over its own part (whose newest sequences
are preempted, their computed blocks kept cached), and the KV pool by memory shares (engine/memory_shares.py): no
tenant's running work evicts another's cached prefixes under its part; memory pressure preempts the tenant furthest
over its own. A request that does not fit (slots or memory) is passed over, not waited for, until it has been passed
over `fairness_steps` times; then it goes first and nothing overtakes it (unless its tenant holds its part while
another waits below its own); one waiting for memory holds back its own tenant's requests alone. While tenants share
the engine, a step holds back the decode rows that would slow another tenant's tokens more than `--tenant-slowdown`
(engine/slowdown.py), and a short request of a tenant with nothing in the step under way runs inside it (lane()), on
the slot of a held-back sequence if its tenant is below its part.

Given latency objectives (a Pace), fairness still decides whose request goes next, and the objectives how much
prefill a step takes: what fits in the slack of the sequences it decodes, plus the requests whose first token would
be late otherwise. A request that needs only a short suffix past its cached prefix fits where a cold one would not,
and goes before the next chunk of a prompt under way. A step grows by no request past the deadline of a first token
it gives: with nothing decoding the slack is unbounded, and the requests that waited for a cold shared prefix,
admitted all in one step, all missed their first tokens; in turn, each in time for its own. A due request goes first
but within the objectives, as a chunk if it does not fit whole: past capacity the backlog becomes due, and each due
request that went past the slack made the answers under way miss their TPOT.
"""
import math
from collections import deque

from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.memory_shares import admit, grow, running_pages
from prefixcache.engine.pace import Pace, to_first_token
from prefixcache.engine.prefill_shares import PrefillShares
from prefixcache.engine.sequence import Plan, Sequence, Status
from prefixcache.engine.slot_shares import claim, rebalance
from prefixcache.engine.slowdown import bounded
from prefixcache.engine.step_cost import StepCost, Work
from prefixcache.engine.turns import turns
from prefixcache.engine.usage import Usage


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int, fairness_steps: int,
                 shared_chunk: int = 0, pace: Pace | None = None, cost: StepCost | None = None,
                 slowdown: float = math.inf):
        self.blocks = blocks
        self.cost = cost or StepCost()
        self.slowdown = slowdown  # the most a step may take over a tenant's own part (engine/slowdown.py)
        self.steps = 0  # steps scheduled
        self.stepping: set[int] = set()  # the sequences of the step under way (or the last one)
        self.laned: dict[int, tuple[Sequence, float]] = {}  # those a lane step ran inside it, and when
        self.left_waiting = False  # the step under way left requests waiting, and no lane step has tried them yet
        self.pace = pace  # None: no objectives, steps are sized by max_batch_tokens alone
        self.shared_chunk = shared_chunk  # 0: off
        self.usage = Usage()  # each tenant's engine use lately (the engine charges each step)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.fairness_steps = fairness_steps
        self.waiting: deque[Sequence] = deque()
        self.shares: dict[str, float] = {}  # tenant -> weight (its cache_share); the rest split equally
        self.running: list[Sequence] = []
        blocks.using = lambda: running_pages(self.running, blocks.pool.local_pages)
        self.num_preemptions = 0
        self.last_was_lane = False  # the last step was a first-token step (see _first_token_lane)
        self.lane_slack = 0.0  # paced: seconds lane steps may take inside the step under way (Scheduler.lane)
        self.step_end = 0.0  # paced: when the step under way ends, as predicted, its lane steps included

    def add(self, seq: Sequence) -> None:
        self.blocks.prepare(seq)
        self.blocks.prefetch(seq)
        self.waiting.append(seq)

    def schedule(self, now: float) -> Plan:
        """(sequence, tokens to compute) pairs: decodes first, then prefill chunks, within the token budget and, with
        objectives, the step's slack (see the module). While several tenants have work, each tenant's prefill tokens
        in a step are capped at `shared_chunk` (if set), except the one that has had the least engine time lately,
        so that one tenant's long prompts keep steps short for the others' first tokens."""
        budget = self.max_batch_tokens
        plan: Plan = []
        rebalance(self.running, self._ready(), self.shares, self.max_num_seqs, self.preempt)
        shares = self._prefill_shares()
        batch = Work(len(self.running), sum(len(s.tokens) for s in self.running))  # a step decoding every one
        limits = self.pace.limits(self.running, self.pace.cost.seconds(batch), now) if self.pace else []
        slack = self.pace.slack(limits) if self.pace else math.inf
        strict = self.pace.limits(self.running, self.pace.tpot, now) if limits else []  # for Pace.spares
        step = Work(len([s for s in self.running if s.num_uncomputed == 1]), 0)  # the decodes' rows, then what joins
        preempted = self.num_preemptions
        order = self._admission_order(now) if slack < math.inf else None  # made again below if the running preempt
        kept = self.pace.kept([(seq, len(m)) for seq, m, _ in order], step, slack, now) if order is not None \
            else Work()
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = shares.allow(seq, min(seq.num_uncomputed, budget))
            if n > 1 and slack < math.inf:
                n = self.pace.cost.most(step + kept, seq.work, n, self.blocks.bs, slack)
            if n == 0:
                continue
            grow(seq, n, self.running, self.blocks, self.shares, self.preempt)
            if seq.status is Status.RUNNING:
                plan.append((seq, n))
                budget -= n
                shares.take(seq, n)
                step += seq.work(n) if n > 1 else Work(0, seq.num_computed + 1)
        plan = [(s, n) for s, n in plan if s.status is Status.RUNNING]
        batch = Work(len(self.running), sum(len(s.tokens) for s in self.running))  # as the running ones are now
        if order is None or self.num_preemptions != preempted:
            order = self._admission_order(now)
        blocked, first = False, math.inf  # paced: seconds to the first-token deadline of one admitted that meets it
        short: set[str] = set()  # tenants whose due request waits for memory: nothing of theirs overtakes it
        for whole in (True, False) if self.pace else (True,):  # paced: requests that fit whole first, then chunks
            for seq, m, due in order:
                if budget == 0 or blocked:
                    break
                if seq.status is not Status.WAITING or seq.scope.tenant in short or \
                        self._waits_for_inflight(seq, m) or not shares.allow(seq, budget):
                    continue
                need = self.pace.allowed(seq, len(m), step, batch, (limits, strict), min(slack, first), now, whole,
                                         self.blocks.bs) if self.pace else \
                    (to_first_token(seq, len(m)).rows if whole else 0)
                if need == 0 and due and whole:
                    break  # it goes first: its chunk, if one fits, before any other request whole
                # nor would a longer step make a first token it gives late
                if need == 0 or self.cost.seconds(step + Work.chunk(len(m), need)) > first:
                    continue
                if self.num_slots + 1 + len(seq.forks) > self.max_num_seqs:
                    blocked = due  # passed over long enough: it waits for slots, and nothing overtakes it
                    continue
                if not admit(seq, m, min(budget, need), frozenset(s.id for s, _ in plan), self.running, self.blocks,
                             self.shares, self.preempt):
                    if due:  # it waits for memory, and nothing of its tenant overtakes it; others' requests may
                        short.add(seq.scope.tenant)
                    continue
                self.waiting.remove(seq)
                self.adopt(seq)
                seq.scheduled_time = seq.scheduled_time or now
                n = shares.allow(seq, min(seq.num_uncomputed, budget, need))
                plan.append((seq, n))
                budget -= n
                shares.take(seq, n)
                step += seq.work(n)
                batch += Work(1, len(seq.tokens))
                due_in = self.pace.deadline(seq) - now if self.pace and n == seq.num_uncomputed else math.inf
                if due_in >= self.cost.seconds(step):  # its first token comes with this step, in time
                    first = min(first, due_in)
        for seq in self.waiting:
            seq.skipped += 1
        if shares.cap is not None:
            plan = self._first_token_lane(plan)
        plan = bounded(plan, self.cost, self.shares, self.slowdown, self.usage.tenants(self.running, self.waiting),
                       self.usage)
        self.steps += 1
        for seq, _ in plan:
            seq.ran_at = self.steps
        self.stepping, self.laned, self.left_waiting = {seq.id for seq, _ in plan}, {}, bool(self.waiting)
        cost = self.cost.seconds(step)  # lane steps delay the step's first tokens too
        self.lane_slack = min(slack - cost if slack < math.inf else cost, first - cost)
        self.step_end = now + cost
        return sorted(plan, key=lambda p: p[1] != 1)  # decode rows first, so they batch into one group

    def lane(self, now: float, admit: bool = True) -> Plan:
        """Inside a step under way (Engine.lane_step): the next token of each sequence a lane step ran inside it, once
        `slowdown` times its row's cost has passed since (its tenant has nothing in the step: its answer goes on at
        the pace the bound gives it, not at the step's), and _admit's: if not `admit`, only of those sequences'
        tenants (a client's next request, after an answer that ran in lanes, need not wait for the step either)."""
        tenants = None if admit else {seq.scope.tenant for seq, _ in self.laned.values()}
        plan, self.left_waiting = self._admit(now, tenants) if admit or tenants else [], False
        ids = {seq.id for seq, _ in plan}
        plan += [(seq, 1) for seq, at in self.laned.values() if seq.id not in ids and seq.status is Status.RUNNING and
                 seq.num_uncomputed == 1 and now - at >= self.slowdown * self.cost.seconds(Work(1, len(seq.tokens)))
                 and self.blocks.grow(seq, 1)]  # room without preempting: else it waits for the step
        self.laned.update((seq.id, (seq, now)) for seq, _ in plan)
        return plan

    @property
    def lane_due(self) -> bool:
        """Whether a lane step may have work though nothing arrived: requests the step under way left waiting, or the
        next tokens of sequences a lane step ran inside it."""
        return self.left_waiting or bool(self.laned)

    def _admit(self, now: float, tenants: set[str] | None) -> Plan:
        """Inside a step under way: waiting requests that need few tokens to reach their next one (short prompts past
        their cached prefix), admitted now, with those tokens. Without objectives: at most
        `shared_chunk` tokens in all, of any tenant; without it, a block's worth, and only of tenants with no
        sequence in the step (the step keeps them waiting). With objectives (a Pace): of any tenant, each one that
        can still meet its first token's deadline and whose step fits in what the step under way leaves of its
        decodes' TPOT slack (`lane_slack`; while none decodes, the lane steps in all take no longer than the step
        itself, so a stream of short requests takes at most about half of a prefill step's time), and only while its
        answer can absorb the wait for its second token, which comes after the step under way ends (Pace.allowance;
        the lane steps admitted after it delay it too). A request whose tenant holds less than its part of the slots
        may take the slot of a sequence the step holds back (engine/slowdown.py), preempted from the tenant running
        furthest over its part. `tenants`: if given, only theirs."""
        plan = []
        if not self.waiting:  # called before every layer of a step: most often, nothing to admit
            return plan
        if self.pace:
            budget, anyone, seconds = self.max_batch_tokens, True, self.lane_slack
            decode = self.cost.seconds(Work(len(self.running) + 1, sum(len(s.tokens) for s in self.running)))
        else:
            budget, anyone, seconds = self.shared_chunk or self.blocks.bs, bool(self.shared_chunk), math.inf
        stepping = {s.scope.tenant for s in self.running if s.id in self.stepping}
        for seq, m, _ in self._admission_order(now):
            need = to_first_token(seq, len(m))
            cost = self.cost.seconds(need)
            if need.rows > budget or (not anyone and seq.scope.tenant in stepping) or \
                    (tenants is not None and seq.scope.tenant not in tenants):
                continue
            # what its answer can absorb past the wait for its second token, at the step's end (Pace.allowance)
            spare = self.pace.allowance(seq, decode) - (self.step_end - now) if self.pace else math.inf
            if self.pace and (self.pace.hopeless(seq, need, now) or cost > seconds or spare < 0):
                continue
            if self._waits_for_inflight(seq, m) or \
                    not claim(seq, self.running, self.shares, self.max_num_seqs, self.stepping, self.preempt) or \
                    not admit(seq, m, None, frozenset(self.stepping), self.running, self.blocks, self.shares,
                              self.preempt):
                continue
            self.waiting.remove(seq)
            self.adopt(seq)
            seq.scheduled_time = seq.scheduled_time or now
            plan.append((seq, seq.num_uncomputed))
            budget -= seq.num_uncomputed
            seconds = min(seconds - cost, spare)  # the lane steps after this one delay its second token too
            self.step_end += cost
        if self.pace:
            self.lane_slack = seconds
        return plan

    @property
    def num_slots(self) -> int:
        """Running sequences, counting the samples that will start from a running prompt."""
        return len(self.running) + sum(len(seq.forks) for seq in self.running)

    def adopt(self, seq: Sequence) -> None:
        """Run a sequence whose blocks are set: just admitted, or a sample that starts from another's computed
        prompt (BlockManager.fork)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back (its computed blocks stay cached) and requeue it."""
        self.blocks.release(seq, finished=False)
        self.num_preemptions += 1
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.skipped = 0
        self.blocks.prepare(seq)
        self.blocks.prefetch(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.usage.finish(seq.scope.tenant)
        self.blocks.release(seq, finished=True)
        self.running.remove(seq)
        seq.status = Status.FINISHED

    def abort(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.finish(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
            seq.status = Status.FINISHED

    def _ready(self) -> list[Sequence]:
        """The waiting requests whose tier lookups and grammars are ready, in arrival order."""
        return [s for s in sorted(self.waiting, key=lambda s: s.arrival) if self.blocks.ready(s) and s.grammar is None]

    def _prefill_shares(self) -> PrefillShares:
        """This step's prefill caps (a deficit round robin over engine use): while two tenants or more have work
        (running or waiting, or finished within NEXT_REQUEST), `shared_chunk` tokens for each, except the one with
        the least engine use lately (none on a tie); else none. A tenant that sends a small request now and then
        caps the others only while its request is in the engine and as long as it has had less than they."""
        tenants = self.usage.tenants(self.running, self.waiting)
        if not self.shared_chunk or len(tenants) < 2:
            return PrefillShares(None)
        return PrefillShares(self.shared_chunk, self.usage.least(tenants))

    def _first_token_lane(self, plan: Plan) -> Plan:
        """While tenants share the engine: a step that gives a request its first token carries no prefill chunk
        that leaves more of its prompt to compute (decode rows stay), unless the step before was such a step. A
        short request admitted between two steps then runs in a step of its own size, and long prompts still get
        every other step. (One that arrives during a step runs inside it: lane().)"""
        first = any(not seq.output_ids and n == seq.num_uncomputed for seq, n in plan)
        chunked = any(n < seq.num_uncomputed for seq, n in plan)
        self.last_was_lane = first and chunked and not self.last_was_lane
        return [(seq, n) for seq, n in plan if n == seq.num_uncomputed] if self.last_was_lane else plan

    def _admission_order(self, now: float) -> list[tuple[Sequence, object, bool]]:
        """The ready requests in the order they are admitted (engine/turns.py), with their cache matches; a request
        whose lookup in the KV tiers below memory, or whose grammar, is not ready waits for it, without a turn."""
        ready = [(seq, self.blocks.match(seq)) for seq in self._ready()]
        late = {seq.id for seq, m in ready if self.pace and self.pace.hopeless(seq, to_first_token(seq, len(m)), now)}
        return turns(ready, late, self.running, self.shares, self.max_num_seqs, self.fairness_steps)

    def _waits_for_inflight(self, seq: Sequence, m) -> bool:
        """True if a running prefill is computing the next block of this request's prefix: wait, then hit."""
        j = len(m.nodes)
        if not self.blocks.reads_cache(seq) or j >= len(seq.cache.keys):
            return False
        nxt = seq.cache.keys[j]
        return any(nxt in s.cache.keys[s.num_computed // self.blocks.bs:] for s in self.running
                   if s.num_uncomputed > 1)
