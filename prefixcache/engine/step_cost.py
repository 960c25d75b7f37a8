"""What an engine step costs, in seconds, learned from the steps the engine has run: a fixed part, a part per row
the weights multiply (a decode row or a prompt token), a part per query-key pair attended, and a part per prompt
token through the LM head (for a request's prompt logprobs: about 0.26 ms a token on SmolLM2, with its log-softmax
and ranks). A step's cost is linear in those on a CPU (the GEMMs are bound by compute, attention by the keys it
reads), so a least-squares fit over the recent steps predicts the next one; the scheduler sizes steps by it against
the latency objectives (engine/pace.py). A step's time is what its tokens wait for: from its start (its scheduling
included) to the next step's, when that follows at once. The machine's speed is shared by every tenant, so this tells
no one anything about another."""
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

WINDOW = 256  # recent steps the fit is over
PRIOR = np.array([0.02, 0.003, 2e-9, 3e-4])  # seconds: a step, a row, a query-key pair, a prompt token's logits;
# replaced as steps are seen
EARLY = 32  # steps after each of which the fit is made again: the prior is far off (a new server's first steps,
# three times too long on SmolLM2, each sized its prefill chunks a third of what fit)
PRIOR_WEIGHT = 0.01  # the prior counts as a hundredth of a step: it decides only what the steps seen leave open


class Work(NamedTuple):  # a tuple, not a dataclass: the scheduler adds hundreds a step
    """A step's size: rows through the weights, query-key pairs attended, and prompt tokens through the LM head
    (a decode row's logits count with its row)."""

    rows: int = 0
    keys: int = 0
    heads: int = 0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.rows + other.rows, self.keys + other.keys, self.heads + other.heads)

    @classmethod
    def chunk(cls, context: int, n: int, logits: bool = False) -> "Work":
        """n tokens computed after `context` tokens: each attends to the ones before it and itself; `logits`: each
        through the LM head too (prompt logprobs)."""
        return cls(n, n * context + n * (n + 1) // 2, n if logits else 0)


class StepCost:
    def __init__(self):
        self.seen: deque[tuple[float, float, float, float]] = deque(maxlen=WINDOW)  # rows, keys, heads, seconds
        self.coef = PRIOR.copy()
        self.unfit = 0  # steps seen since the last fit
        self.pending: tuple[Work, float] | None = None  # the last step's work and start, while the next follows it

    def seconds(self, work: Work) -> float:
        """The predicted seconds of a step of this size."""
        step, row, key, head = self.coef
        return float(step + row * work.rows + key * work.keys + head * work.heads)

    def most(self, step: Work, chunk: Callable[[int], Work], n: int, least: int, limit: float) -> int:
        """The most of n prompt tokens (`chunk`: the work of so many) that a step of `step` so far can add within
        `limit` seconds, but at least `least` (n, if fewer): a prompt's chunk always moves on."""
        if self.seconds(step + chunk(n)) <= limit:
            return n
        lo, hi = min(n, least), n  # lo fits (or is the floor), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.seconds(step + chunk(mid)) <= limit else (lo, mid)
        return lo

    def per_token(self, context: int) -> float:
        """The predicted seconds one more prompt token after `context` costs a step."""
        return float(self.coef[1] + self.coef[2] * (context + 1))

    def starting(self) -> float:
        """A step starts now (returned): the one before it, if it ran back to back with this one, cost the time until
        now."""
        now = time.monotonic()
        if self.pending:
            self.record(self.pending[0], now - self.pending[1])
            self.pending = None
        return now

    def ran(self, work: Work, began: float, follows: bool) -> None:
        """A step of this work ran from `began` until now; `follows`: the next step follows at once (the engine has
        work left), and this one's cost is the time until that one starts: what its tokens wait for includes their
        handing out to the requests and the adding of the requests that came meanwhile."""
        if follows:
            self.pending = work, began
        else:
            self.record(work, time.monotonic() - began)

    def record(self, work: Work, seconds: float) -> None:
        """A step of this size took this long; refit after each of the first steps, then every few."""
        self.seen.append((work.rows, work.keys, work.heads, seconds))
        self.unfit += 1
        if self.unfit >= (1 if len(self.seen) < EARLY else 8):
            self.fit()

    def fit(self) -> None:
        """Ridge least squares toward the prior, each part at least zero: a part the fit would make negative is set to
        zero and the others fitted again without it (clipping it alone would leave the others' error in: after one
        step of 512 prompt tokens, 1.2 s predicted for that very step against 0.55 s seen). Errors count relative to
        each step's length: absolute ones let the long prefill steps set the fixed part, and a decode step of 5 ms
        was predicted at 30 (engine/slowdown.py bounds others' work by it)."""
        self.unfit = 0
        data = np.array(self.seen)
        w = 1 / np.maximum(data[:, 3], 1e-3)  # each step's error relative to its length
        x = np.column_stack([np.ones(len(data)), data[:, :3]]) * w[:, None]
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # columns to one range, so the ridge weighs each alike
        xs, prior = x / scale, PRIOR * scale
        free = [0, 1, 2, 3]
        while True:
            coef = np.zeros(4)
            a, ridge = xs[:, free], PRIOR_WEIGHT * np.eye(len(free))
            coef[free] = np.linalg.solve(a.T @ a + ridge, a.T @ (data[:, 3] * w) + ridge @ prior[free])
            if coef.min() >= 0:
                break
            free.remove(int(coef.argmin()))
        self.coef = coef / scale
