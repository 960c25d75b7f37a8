"""Steps sized against the latency objectives (`--slo-ttft-ms`, `--slo-tpot-ms`), on a clock passed in.

A running sequence that may write m tokens meets its TPOT objective if its last comes by first + tpot * (m - 1). If
the steps after this one take what a decode step takes, this step may take what is left of that, but never more than
the objective itself: the prefill it carries beside the decodes is what fits, by the step's predicted cost
(engine/step_cost.py). Both objectives are aimed at AIM of their value.
A request joins the running ones only while a step decoding them all stays within the TPOT objective.

A waiting request meets its TTFT objective if its prompt's uncached part is computed by arrival + ttft: it is
*hopeless* once even a step of its own now would end after that, and *urgent* once waiting one more step would. An
urgent request is admitted though its prefill overruns the step's slack if the answers decoding are far enough ahead
of their objective to absorb it (Pace.spares: a missed first token cannot be made up, but past the engine's capacity
admitting every urgent one past the slack made every answer under way late); a hopeless one goes behind the others of
its tenant.
"""
import math

from prefixcache.engine.sequence import Plan, Sequence
from prefixcache.engine.step_cost import StepCost, Work

AIM = 0.9  # the share of each objective a schedule aims at: a step's predicted cost errs, and the client sees each
# token later than the step that wrote it (multi-tenant at 2.5 req/s, aiming at the objectives themselves: paced TPOTs
# of 120-123 ms against 120, first tokens at 1.03-1.10 s against 1)


class Pace:
    def __init__(self, ttft: float | None, tpot: float | None, cost: StepCost):
        self.ttft = ttft and ttft * AIM
        self.tpot = tpot and tpot * AIM
        self.cost = cost

    def limits(self, running: list[Sequence], decode: float, now: float) -> list[float]:
        """For each sequence the next step decodes, the seconds that step may take so that it can still meet its TPOT
        objective over its whole answer, if each step after it takes `decode` seconds (none: no objective)."""
        if self.tpot is None:
            return []
        # an answer's last token, at most max_tokens in, is due at first + tpot * (max_tokens - 1), and the steps
        # after this one write its tokens between this one's and the last
        return [s.first_token_time + self.tpot * (s.params.max_tokens - 1)
                - decode * (s.params.max_tokens - len(s.output_ids) - 1) - now
                for s in running if s.first_token_time is not None]

    def slack(self, limits: list[float]) -> float:
        """Seconds the next step may take: within every decoding sequence's limit (inf: none decoding), and never
        longer than the objective, since slack spent early is not there when the next cold prompt comes."""
        return min(min(limits), self.tpot) if limits else math.inf

    def spares(self, limits: list[float], strict: list[float], step: Work, longer: Work) -> bool:
        """A step of `longer` rather than `step` costs no decoding sequence its objective: none that can still meet
        it (`limits`, as `limits` gives them with the steps after this one decoding only) is then behind an answer
        whose every step takes the objective (`strict`: `limits` with steps of the objective after this one), so no
        later step must be shorter than the objective to make up for it."""
        before, after = self.cost.seconds(step), self.cost.seconds(longer)
        return not any(limit >= before and ahead < after for limit, ahead in zip(limits, strict))

    def allowance(self, seq: Sequence, decode: float) -> float:
        """The longest wait from its first token to its second with which its answer can still meet the TPOT
        objective, if each token after that takes a step of `decode` seconds (a request admitted in a lane step
        inside a long step gets its second token only when that step ends)."""
        m = seq.params.max_tokens
        return math.inf if self.tpot is None or m <= 1 else self.tpot * (m - 1) - decode * (m - 2)

    def room(self, batch: Work, tokens: int) -> bool:
        """A sequence of this many tokens may join `batch` (the running ones, decoding): the step decoding them all
        stays within the TPOT objective, or none is running."""
        return self.tpot is None or not batch.rows or self.cost.seconds(batch + Work(1, tokens)) <= self.tpot

    def deadline(self, seq: Sequence) -> float:
        """When the request's first token is due (inf without a TTFT objective)."""
        return math.inf if self.ttft is None else seq.arrival + self.ttft

    def hopeless(self, seq: Sequence, work: Work, now: float) -> bool:
        """Even a step of its own, started now, would give its first token after its deadline."""
        return now + self.cost.seconds(work) > self.deadline(seq)

    def urgent(self, seq: Sequence, work: Work, step: Work, now: float) -> bool:
        """It can still meet its deadline, but not if it waits for a step of this size first."""
        return not self.hopeless(seq, work, now) and now + self.cost.seconds(step) + self.cost.seconds(work) > \
            self.deadline(seq)

    def kept(self, waiting: Plan, step: Work, slack: float, now: float) -> Work:
        """The part of the step's slack kept for the waiting requests (with their cached tokens) that fit in it whole
        and can still meet their first token (a short suffix past a cached prefix, mostly): a running prompt's chunk
        takes what they leave, so a cold prompt under way does not make them wait."""
        kept = Work()
        for seq, cached in waiting:
            work = to_first_token(seq, cached)
            if not self.hopeless(seq, work, now) and self.cost.seconds(step + kept + work) <= slack:
                kept += work
        return kept

    def allowed(self, seq: Sequence, cached: int, step: Work, batch: Work, limits: tuple[list[float], list[float]],
                slack: float, now: float, whole: bool, least: int) -> int:
        """How many of a waiting request's prompt tokens this step may compute (0: it waits). None while one more
        sequence decoding would make every step longer than the TPOT objective. First (`whole`): all of them, if
        they fit the step's slack, or waiting longer would make it miss its first token's deadline and the longer
        step costs no answer under way its objective (`limits`: spares' two). Then, from what slack is left: a
        chunk, if `least` tokens fit (StepCost.most)."""
        work = to_first_token(seq, cached)
        if not self.room(batch, len(seq.tokens)):
            return 0
        if self.cost.seconds(step + work) <= slack or \
                (self.urgent(seq, work, step, now) and self.spares(*limits, step, step + work)):
            return work.rows if whole else 0
        if whole:
            return 0
        n = self.cost.most(step, lambda m: Work.chunk(cached, m), work.rows, least, slack)
        return n if self.cost.seconds(step + Work.chunk(cached, n)) <= slack else 0


def to_first_token(seq: Sequence, cached: int) -> Work:
    """A waiting request's work to its first token: its prompt past the cached prefix."""
    return Work.chunk(cached, len(seq.tokens) - cached)
