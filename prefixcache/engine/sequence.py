"""A request's state as it moves through the engine, and the parameters and output a caller sees."""
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from prefixcache.cache.scope import CacheScope

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


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


@dataclass(frozen=True)
class Breakpoint:
    """Cache the prompt prefix that ends at token `position`, for `ttl` ("5m" or "1h")."""

    position: int
    ttl: str = "5m"

    def __post_init__(self):
        if self.ttl not in TTL_SECONDS:
            raise ValueError(f"ttl must be one of {sorted(TTL_SECONDS)}, got {self.ttl!r}")


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
        self.nodes: list = []  # cache nodes of blocks 0.. (matched or published), in order
        self.keys: list[bytes] = []  # chain keys of full blocks, extended as tokens arrive
        self.num_computed = 0  # tokens whose K/V are in the pool
        self.num_cached: int | None = None  # prompt tokens served from the cache at first admission
        self.shared_len = 0  # leading tokens that belong to an operator-declared shared prefix
        self.partials_done: set[int] = set()
        self.cache_write: dict[str, int] = {}
        self.write_counted = 0  # prompt position up to which cache writes were counted
        self.scope_kind = "none"
        self.miss_cause = "cold"
        self.cross_scope_miss = False  # another scope holds the block where the match stopped (operator log only)
        self.skipped = 0  # admission rounds this request was passed over
        self.finish_reason: str | None = None
        self.text = ""
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed
