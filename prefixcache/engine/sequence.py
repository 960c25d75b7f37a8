"""A request's state as it moves through the engine, and the parameters and output a caller sees."""
import itertools
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import Enum

from prefixcache.cache.policy import Breakpoint, WritePolicy
from prefixcache.cache.scope import CacheScope
from prefixcache.engine.detokenizer import Detokenizer
from prefixcache.engine.drafting import Drafting
from prefixcache.engine.grammar import Matcher
from prefixcache.engine.guide import Guide
from prefixcache.engine.step_cost import Work

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p times the likeliest (after temperature) are dropped
    max_tokens: int | None = None  # None: the engine's Config.max_tokens
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # sample i of n gets seed + i
    ignore_eos: bool = False
    # penalties and biases, applied in this order before temperature (as vLLM does):
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, -100..100
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and stop strings ignored) until this many tokens
    repetition_penalty: float = 1.0  # vLLM's: over prompt and output, positive logits / p, negative ones * p
    frequency_penalty: float = 0.0  # OpenAI's, over output tokens: minus penalty * count
    presence_penalty: float = 0.0  # OpenAI's, over output tokens: minus penalty if present
    stop_token_ids: list[int] = field(default_factory=list)  # finish (reason "stop") on any of these tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may come next
    bad_words: list[list[int]] = field(default_factory=list)  # vLLM's: token sequences the output may not complete
    skip_special_tokens: bool = True  # special tokens' text is left out of the output text
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) that ended the output stays
    logprobs: int | None = None  # None: none; k: each sampled token's logprob and the k most likely tokens
    prompt_logprobs: int | None = None  # the same for prompt tokens; the prompt is then recomputed, not cached
    n: int = 1  # samples returned
    best_of: int | None = None  # samples generated (>= n); the n with the highest cumulative logprob are returned
    guide: Guide | None = None  # structured output: the grammar the output must follow
    speculative: bool = True  # False: never draft for this request (when the engine's speculation is on)

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must hold at least one token id")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(-100 <= b <= 100 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.guide and self.min_tokens:  # the grammar may end sooner: then no token would be allowed
            raise ValueError("min_tokens cannot be combined with structured output (response_format, guided_regex, "
                             "guided_choice or a forced tool call): the grammar may complete before min_tokens")

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n

    @property
    def penalized(self) -> bool:
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1 or self.frequency_penalty
                    or self.presence_penalty or self.allowed_token_ids is not None or self.bad_words)

    def sample(self, i: int) -> "SamplingParams":
        """The parameters of sample i of a request: its own seed; the prompt's logprobs belong to sample 0."""
        seed = None if self.seed is None else self.seed + i
        return replace(self, seed=seed, prompt_logprobs=self.prompt_logprobs if i == 0 else None)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's raw logits (before penalties, biases and temperature)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their logprobs, best first
    rank: int | None = None  # 1 + the tokens more likely than it (prompt logprobs only: vLLM's format shows it)


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    cached_tokens: int  # prompt tokens whose prefill was skipped
    cache_write_tokens: dict[str, int]  # prompt tokens newly written to the cache, by TTL ("5m", "1h", "auto")
    scope_kind: str  # "own", "shared" or "none": where the matched prefix came from
    miss_cause: str  # why the match stopped at cached_tokens, judged only from scopes the request may read:
    # hit, diverged, evicted, expired, below_min_length, cold (nothing cached), disabled
    ttft: float | None  # seconds from arrival to first token
    latency: float | None
    queue_time: float | None = None  # seconds from arrival to its first step
    index: int = 0  # which of the request's samples this is
    cumulative_logprob: float = 0.0  # of the output tokens, under the raw logits
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first)
    accepted_draft_tokens: int = 0  # output tokens that came from verified speculative drafts
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # cached_tokens by tier: L1, L2, L3
    error: str | None = None  # why the request failed alone (finish_reason "abort"), if it did


def best(outputs: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The n of a request's samples to return: all of them in order, or (best_of > n) the n with the highest
    cumulative logprob, best first."""
    if len(outputs) == n:
        return outputs
    return sorted(outputs, key=lambda o: -o.cumulative_logprob)[:n]


@dataclass
class CacheState:
    """A request's side of the prefix cache. Written only by the BlockManager."""

    keys: list[bytes] = field(default_factory=list)  # chain keys of full blocks, extended as tokens arrive
    nodes: list = field(default_factory=list)  # cache nodes of blocks 0.. (matched or published), in order
    shared_len: int = 0  # leading tokens that belong to an operator-declared shared prefix
    policy: WritePolicy | None = None
    partials_done: set[int] = field(default_factory=set)
    num_cached: int | None = None  # prompt tokens served from the cache at first admission
    write: dict[str, int] = field(default_factory=dict)  # prompt tokens written, by TTL label
    write_counted: int = 0  # prompt position up to which writes were counted
    scope_kind: str = "none"
    miss_cause: str = "cold"
    cross_scope_miss: bool = False  # another scope holds the block where the match stopped (operator log only)
    fetch: Future | None = None  # a lookup in the KV tiers below host memory, while it runs
    fetch_from: int = 0  # the first block it looks up (then: the first of `found` not loaded yet)
    found: list = field(default_factory=list)  # what the lookup found, still to load (engine/tiering.py)
    tier_tokens: dict[str, int] = field(default_factory=dict)  # prompt tokens loaded from "L2" / "L3"

    def by_tier(self) -> dict[str, int]:
        """Cached prompt tokens by the tier they came from: L1 (host memory), L2 (disk), L3 (Redis)."""
        cached = self.num_cached or 0
        loaded = {t: min(n, cached) for t, n in sorted(self.tier_tokens.items())}
        return {"L1": max(0, cached - sum(loaded.values())), **loaded}


@dataclass(frozen=True)
class Fault:
    """Why one sequence failed while the step went on for the others."""

    message: str
    internal: bool  # the engine's fault (a 500), not the request's (a 400)


class Status(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt: list[int], params: SamplingParams, scope: CacheScope,
                 breakpoints: list[Breakpoint] = (), priority: int = 0, *, detok: Detokenizer | None = None,
                 grammar: Future | None = None, draft_len: int = 0, samples: list["Sequence"] | None = None):
        """A sequence of its own; request_samples() makes those of a request, which share `samples`. `detok`
        (None: no text), `grammar` (the guide's, compiling off the engine thread), `draft_len` (0: no drafts)."""
        self.id = next(_ids)
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.params = params
        self.scope = scope
        self.breakpoints = sorted(breakpoints, key=lambda b: b.position)
        self.priority = priority
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0  # tokens whose K/V are in the pool
        self.local = range(0)  # the blocks whose local part it holds (cache/pool.py): those its local layers read
        self.cache = CacheState()
        self.skipped = 0  # admission rounds this request was passed over
        self.ran_at = 0  # the last scheduler step that computed it (0: none yet)
        self.finish_reason: str | None = None
        self.fault: Fault | None = None  # set when this sequence failed alone (finish_reason "abort")
        # the base of its random numbers: a token's draw depends only on it and the token's position
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.text = ""  # the output text (cut at a stop string)
        self.detok = detok
        self.grammar = grammar  # until it has compiled; then the matcher
        self.matcher: Matcher | None = None  # the guide's grammar state, once the grammar is compiled
        self.arrival = time.monotonic()
        self.scheduled_time: float | None = None  # when it was first admitted to a step
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.index = 0 if samples is None else len(samples)  # which of its request's samples this is
        self.samples = [self] if samples is None else samples  # the request's; samples[0] computes the prompt
        self.forks: list[Sequence] = []  # samples waiting to start from this one's prompt (samples[0] only)
        self.cumulative_logprob = 0.0
        self.drafting = Drafting(draft_len)  # speculation: the next draft's length, and pauses
        self.accepted_draft_tokens = 0
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] * self.num_prompt if params.prompt_logprobs is not None else None

    def work(self, n: int) -> Work:
        """Its next n tokens, as a step's cost counts them (engine/step_cost.py)."""
        return Work.chunk(self.num_computed, n, logits=self.prompt_logprobs is not None and self.num_uncomputed > 1)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    def scope_at(self, end: int) -> CacheScope:
        """A block or partial ending at token `end` is shared only if it lies inside a declared shared prefix."""
        return self.scope.shared if end <= self.cache.shared_len else self.scope

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    def output(self) -> RequestOutput:
        """What the caller sees of this sequence, now."""
        end, c, first = self.finish_time, self.cache, self.first_token_time
        return RequestOutput(
            request_id=self.id, prompt_token_ids=self.tokens[:self.num_prompt], token_ids=self.output_ids,
            text=self.text, finish_reason=self.finish_reason, cached_tokens=c.num_cached or 0,
            cache_write_tokens=dict(c.write), scope_kind=c.scope_kind, miss_cause=c.miss_cause,
            ttft=first - self.arrival if first else None, latency=end - self.arrival if end else None,
            queue_time=self.scheduled_time - self.arrival if self.scheduled_time else None,
            index=self.index, cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs and list(self.logprobs),
            prompt_logprobs=self.prompt_logprobs and list(self.prompt_logprobs),
            accepted_draft_tokens=self.accepted_draft_tokens, cached_by_tier=c.by_tier(),
            error=self.fault.message if self.fault else None,
        )

Plan = list[tuple[Sequence, int]]  # a step's sequences and the tokens each computes in it


def request_samples(prompt: list[int], params: SamplingParams, scope: CacheScope, breakpoints: list[Breakpoint],
                    priority: int, detok: Callable[[], Detokenizer], grammar: Future | None,
                    draft_len: int) -> list[Sequence]:
    """A request's params.num_samples samples: samples[0] computes the prompt, the others wait in its forks to
    start from its blocks (sample i draws with seed + i)."""
    samples: list[Sequence] = []
    for i in range(params.num_samples):
        samples.append(Sequence(prompt, params.sample(i), scope, breakpoints, priority, detok=detok(),
                                grammar=grammar, draft_len=draft_len, samples=samples))
    samples[0].forks = samples[1:]
    return samples
