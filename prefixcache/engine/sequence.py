"""A request's state as it moves through the engine, and the parameters and output a caller sees."""
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from prefixcache.cache.policy import Breakpoint, WritePolicy
from prefixcache.cache.scope import CacheScope
from prefixcache.engine.detokenizer import Detokenizer


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens is None or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]


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


class Status(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt: list[int], params: SamplingParams, scope: CacheScope,
                 breakpoints: list[Breakpoint] = (), priority: int = 0):
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
        self.cache = CacheState()
        self.skipped = 0  # admission rounds this request was passed over
        self.finish_reason: str | None = None
        self.text = ""  # the output text (cut at a stop string)
        self.detok: Detokenizer | None = None  # set by the engine, which has the tokenizer
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed
