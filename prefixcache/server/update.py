"""What the engine thread hands a request's handler: Update (a sample's new text and tokens' logprobs since the
last one) and Report (the request's counts as of it), both copied there, so handlers never read a live Sequence."""
from dataclasses import dataclass, field

from prefixcache.engine.sequence import RequestOutput, Sequence, TokenLogprob


@dataclass(frozen=True)
class Report:
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    cache_write: dict[str, int]  # complete for breakpoints once the first token exists
    scope_kind: str
    miss_cause: str
    cross_scope_miss: bool
    accepted_draft_tokens: int  # output tokens from verified speculative drafts
    cached_by_tier: dict[str, int]  # cached_tokens by the tier they came from: L1, L2, L3

    @classmethod
    def of(cls, seq: Sequence) -> "Report":
        c = seq.cache
        return cls(seq.num_prompt, len(seq.output_ids), c.num_cached or 0, dict(c.write), c.scope_kind, c.miss_cause,
                   c.cross_scope_miss, seq.accepted_draft_tokens, c.by_tier())


@dataclass
class Update:
    text: str  # the sample's output text since its previous update
    times: list[float]  # time.monotonic() on the engine thread, of each step this update covers
    report: Report | None = None  # None on an error
    output: RequestOutput | None = None  # set on the last update
    error: str | None = None  # the engine refused the request (ValueError) or failed
    status: int = 400  # of the error: 400 the request's fault, 429 its tenant's work waiting, 500 the engine's
    index: int = 0  # which of the request's samples this is about
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens it added, when asked for
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # with a sample's first token, when asked for

    def merge(self, later: "Update") -> None:
        """Take in the same sample's next update (this one was not read yet)."""
        assert later.index == self.index and self.output is None and self.error is None and later.error is None
        self.text += later.text
        self.times += later.times
        self.logprobs += later.logprobs
        self.report, self.output = later.report, later.output
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
