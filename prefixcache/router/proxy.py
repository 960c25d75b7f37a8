"""Forwarding one request: look up its block keys, choose a replica, send, and retry elsewhere while nothing of
the response has reached the client yet.

The router never authenticates: the client's headers (its API key among them) go to the replica unchanged, and
the replica's answer, errors included, comes back unchanged. Non-streamed answers are read whole before they are
sent on, so a replica that dies mid-answer is retried; a stream is sent on from its first chunk, and a replica that
dies after that ends the client's connection (a stream is never replayed).
"""
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from prefixcache.router.balance import Candidate, Policy, choose
from prefixcache.router.config import RouterConfig
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.replicas import Replica
from prefixcache.router.usage import SseUsage, cached_tokens
from prefixcache.server.errors import ApiError

KEYS_TIMEOUT = 5.0  # seconds for a /v1/cache/keys lookup; past it the request is routed by load alone
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade"}
REQUEST_SKIP = HOP_BY_HOP | {"host", "content-length"}  # httpx sets them for the replica
RESPONSE_SKIP = HOP_BY_HOP | {"content-length", "date", "server"}  # the router's own server sets them
AUTH_HEADERS = ("authorization", "x-api-key")

log = logging.getLogger("prefixcache.router")


class Router:
    """The replicas, the index and the policy, and the forwarding of requests over them."""

    def __init__(self, replicas: list[Replica], index: PrefixIndex | None, policy: Policy, max_retries: int,
                 metrics: RouterMetrics, max_model_len: int = RouterConfig.max_model_len):
        self.replicas, self.index, self.policy, self.max_retries = replicas, index, policy, max_retries
        self.metrics, self.max_model_len = metrics, max_model_len
        self.turn = 0  # round-robin's position
        self.client: httpx.AsyncClient | None = None  # set while the app runs

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    async def keys(self, path: str, body: bytes, headers) -> tuple[list[str], int]:
        """The request's block keys (at most the context's full blocks: what the router holds of a request is
        bounded) and block size, from any healthy replica; ([], 0) when there is no index or the lookup fails (the
        request is then routed by load, and the replica answers any error itself)."""
        healthy = self.healthy()
        if self.index is None or not healthy:
            return [], 0
        try:
            payload = {"path": path, "body": json.loads(body)}
        except ValueError:
            return [], 0
        auth = {h: headers[h] for h in AUTH_HEADERS if h in headers}
        try:
            r = await self.client.post(f"{random.choice(healthy).url}/v1/cache/keys", json=payload, headers=auth,
                                       timeout=KEYS_TIMEOUT)
            if r.status_code != 200:
                return [], 0
            answer = r.json()
            block_size = int(answer["block_size"])
            return list(answer["keys"][:self.max_model_len // block_size]), block_size
        except (httpx.HTTPError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            log.info("cache keys lookup failed (%s); routing by load", type(e).__name__)
            return [], 0

    def pick(self, keys: list[str], tried: set[str]) -> tuple[Replica, int] | None:
        """A healthy replica not tried yet, and its match length; None when there is none left."""
        left = [r for r in self.healthy() if r.url not in tried]
        if not left:
            return None
        if self.policy.kind == "round-robin":
            self.turn += 1
            self.metrics.decisions.labels("round-robin").inc()
            return left[self.turn % len(left)], 0
        random.shuffle(left)  # choose() gives ties to the first: spread them
        matches = {r.url: self.index.match(r.replica_id, keys) if self.index else 0 for r in left}
        decision = choose([Candidate(r.url, r.load, matches[r.url]) for r in left], len(keys), self.policy)
        self.metrics.decisions.labels(decision.reason).inc()
        return next(r for r in left if r.url == decision.replica.url), matches[decision.replica.url]

    async def forward(self, request: Request) -> Response:
        path, body = request.url.path, await request.body()
        target = path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k not in REQUEST_SKIP}
        keys, block_size = await self.keys(path, body, request.headers)
        tried: set[str] = set()
        failed: Response | None = None  # the last 5xx answer, passed on when no retry is left
        for _ in range(1 + self.max_retries):
            picked = self.pick(keys, tried)
            if picked is None:
                break
            replica, match = picked
            tried.add(replica.url)
            if self.index:
                self.index.expect(replica.replica_id, keys)
            replica.in_flight += 1
            answer = None
            try:
                answer = await self.attempt(replica, target, body, headers, match * block_size)
            except httpx.TransportError as e:
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    replica.down(f"connect: {type(e).__name__}")
                self.metrics.retries.labels(replica.url).inc()
                log.warning("%s failed on %s before answering (%s); trying another replica", path, replica.url,
                            type(e).__name__)
                continue
            finally:
                if not isinstance(answer, Relay):
                    replica.in_flight -= 1
            if answer.status_code >= 500 and not isinstance(answer, Relay):
                self.metrics.retries.labels(replica.url).inc()
                failed = answer
                continue
            self.metrics.requests.labels(replica.url).inc()
            return answer
        if failed is not None:
            return failed
        raise ApiError(503, "no healthy replica could take the request; retry later", retry_after=1)

    async def attempt(self, replica: Replica, target: str, body: bytes, headers: dict[str, str],
                      predicted: int) -> Response:
        """Send the request to one replica and return its answer: whole, or (an event stream) as a Relay that owns
        the replica's connection and its in-flight count from here on. Raises httpx.TransportError while no byte
        of the answer has been passed on."""
        request = self.client.build_request("POST", replica.url + target, content=body, headers=headers)
        upstream = await self.client.send(request, stream=True)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in RESPONSE_SKIP}
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            if upstream.status_code < 500:
                try:
                    parsed = json.loads(content)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    self.metrics.usage(replica.url, predicted, cached_tokens(parsed))
            return Response(content, upstream.status_code, out_headers)
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks, b"")
        except BaseException:
            await upstream.aclose()
            raise

        async def release() -> None:
            replica.in_flight -= 1
            await upstream.aclose()

        return Relay(self.relay(replica, chunks, first, predicted), upstream.status_code, out_headers, release)

    async def relay(self, replica: Replica, chunks: AsyncIterator[bytes], first: bytes,
                    predicted: int) -> AsyncIterator[bytes]:
        usage = SseUsage()
        usage.feed(first)
        yield first
        try:
            async for chunk in chunks:
                usage.feed(chunk)
                yield chunk
        except httpx.TransportError as e:
            log.warning("stream from %s broke after it started (%s); the client's connection is ended", replica.url,
                        type(e).__name__)
            raise
        self.metrics.usage(replica.url, predicted, usage.cached)


class Relay(StreamingResponse):
    """A replica's event stream passed on to the client. `release` runs once the response ends however it ends
    (finished, client gone, replica gone), even if the body was never started."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int, headers: dict[str, str],
                 release: Callable[[], Awaitable[None]]):
        super().__init__(content, status_code, headers)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()
