"""Generation: one submitted request seen from its HTTP handler: admission, text deltas of each of its samples,
accounting, log line."""
import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from prefixcache.engine.sequence import RequestOutput, SamplingParams, TokenLogprob
from prefixcache.server.errors import ApiError
from prefixcache.server.metrics import Metrics
from prefixcache.server.update import Report, Update
from prefixcache.server.worker import EngineWorker, Handle

log = logging.getLogger("prefixcache.request")

DISCONNECT_POLL_SECONDS = 0.25
CLIENT_CLOSED = 499  # nginx's status for a request the client gave up on


@dataclass
class Sample:
    """One of the request's samples (n > 1, best_of), as the handler has seen it."""

    sent: str = ""  # text handed out
    report: Report | None = None
    output: RequestOutput | None = None  # set when it finished
    logprobs: list[TokenLogprob] = field(default_factory=list)  # received, not yet handed out
    token_times: list[float] = field(default_factory=list)


@dataclass
class Delta:
    index: int  # the sample's
    text: str
    logprobs: list[TokenLogprob]  # of the tokens since the previous delta (their text may still be held back)


class Generation:
    def __init__(self, worker: EngineWorker, metrics: Metrics, handle: Handle, api: str, tenant: str,
                 params: SamplingParams, where: Callable[[int], str] | None = None, log_misses: bool = False):
        self.worker, self.metrics, self.handle, self.api, self.tenant = worker, metrics, handle, api, tenant
        self.where, self.log_misses = where, log_misses  # log_misses: Config.log_cross_scope_misses
        self.request = None  # the HTTP request, whose disconnect aborts this one; set by start()
        self.pending: Update | None = None
        self.report: Report | None = None  # the latest counts, from the engine thread's updates
        self.samples = [Sample() for _ in range(params.num_samples)]
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, when asked for
        self.start_time = time.monotonic()

    @property
    def output(self) -> RequestOutput | None:
        """Sample 0's output; it carries the prompt's counts and logprobs."""
        return self.samples[0].output

    @property
    def outputs(self) -> list[RequestOutput | None]:
        return [s.output for s in self.samples]

    @property
    def completion_tokens(self) -> int:
        return sum(s.report.output_tokens for s in self.samples if s.report)

    @property
    def accepted_draft_tokens(self) -> int:
        return sum(s.report.accepted_draft_tokens for s in self.samples if s.report)

    async def start(self, request) -> None:
        """Wait until the first token (so the cached prefix is known). An engine refusal becomes an ApiError;
        a client that hangs up meanwhile (e.g. while queued) gets its request aborted."""
        self.request = request
        self.pending = await self._unless_disconnected(self._next())

    async def _unless_disconnected(self, work):
        """Await `work`; if the client hangs up first, abort the request and raise."""
        task = asyncio.ensure_future(work)
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS))[0]:
            if await self.request.is_disconnected():
                task.cancel()
                self.close(CLIENT_CLOSED)
                raise ApiError(CLIENT_CLOSED, "client closed the request")
        return task.result()

    @property
    def prompt_tokens(self) -> int:
        return self.report.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.report.cached_tokens

    @property
    def cache_write(self) -> dict[str, int]:
        """Prompt tokens written to the cache by TTL; complete for breakpoints once the first token exists."""
        return self.output.cache_write_tokens if self.output else self.report.cache_write

    @property
    def miss_at(self) -> str | None:
        """Where in the request (message and offset, for chats) the cached match stopped; None on a full hit."""
        if self.report.miss_cause in ("hit", "disabled") or self.where is None:
            return None
        return self.where(self.cached_tokens)

    def header(self) -> dict[str, str]:
        r = self.report
        at = f"; {self.miss_at}" if self.miss_at else ""
        tiers = ",".join(f"{t}:{n}" for t, n in r.cached_by_tier.items())
        return {"x-prefix-cache": f"cached={r.cached_tokens}; prompt={r.prompt_tokens}; scope={r.scope_kind}; "
                                  f"tiers={tiers}; miss={r.miss_cause}{at}"}

    async def deltas(self):
        """New output text of each sample (the worker holds back what may still become a stop string or an
        incomplete character), with the logprobs received since (the rest with the last delta)."""
        try:
            while not all(self.outputs):
                u = self.pending or await self._next()
                self.pending = None
                s = self.samples[u.index]
                s.logprobs += u.logprobs
                s.output = u.output
                if u.text or (u.output and s.logprobs):
                    s.sent += u.text
                    yield Delta(u.index, u.text, s.logprobs)
                    s.logprobs = []
        finally:
            self.close()

    async def texts(self) -> list[str]:
        """Each sample's whole text; a client that hangs up meanwhile gets its request aborted."""
        async def read():
            async for _ in self.deltas():
                pass
        await self._unless_disconnected(read())
        return [s.sent for s in self.samples]

    def close(self, status: int = 200) -> None:
        if self.handle.done:
            return
        self.worker.finished(self.handle)
        out, m = self.output, self.metrics
        aborted = out is None and status in (200, CLIENT_CLOSED)
        for s in self.samples:
            if s.output is not None:
                m.finish(s.output, s.token_times)
        if aborted:
            m.abort()
        if status != 200:  # errors are counted and logged where they are rendered
            return
        m.status(self.api, status)
        r = self.report
        line = {
            "api": self.api, "tenant": self.tenant, "status": status,
            "finish_reason": out.finish_reason if out else "abort", "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "cached_by_tier": r.cached_by_tier,
            "completion_tokens": self.completion_tokens,
            "cache_write_tokens": self.cache_write, "scope": r.scope_kind, "miss": r.miss_cause,
            "miss_at": self.miss_at, "accepted_draft_tokens": self.accepted_draft_tokens,
            "ttft": round(out.ttft, 4) if out and out.ttft else None,
            "latency": round(time.monotonic() - self.start_time, 4),
        }
        if self.log_misses:
            line["cross_scope_miss"] = r.cross_scope_miss
        log.info(json.dumps(line))

    def stream_failed(self, e: ApiError) -> None:
        """The request failed after its stream began, so no error handler renders it: count and log it here."""
        self.metrics.status(self.api, e.status)
        log.info(json.dumps({"api": self.api, "tenant": self.tenant, "status": e.status, "error": e.message,
                             "streamed": True}))

    async def _next(self) -> Update:
        u = await self.handle.updates.get()
        if u.error is not None:
            self.close(u.status)
            raise ApiError(u.status, u.error, retry_after=1 if u.status == 429 else None)
        s = self.samples[u.index]
        s.token_times += u.times
        self.report = s.report = u.report
        if u.prompt_logprobs is not None:
            self.prompt_logprobs = list(u.prompt_logprobs)
        return u
