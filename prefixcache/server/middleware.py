"""The ASGI layers in front of both APIs: the caller's admission, the request body limit, and the metrics port's one
route."""
import asyncio

from starlette.requests import Request

from prefixcache.server.errors import ApiError, api_of

METRICS_PORT = "prefixcache.metrics_port"  # in a request's scope: it came in on --metrics-port
CHARGED = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize", "/detokenize",
           "/v1/completions/render", "/v1/chat/completions/render", "/v1/cache"}  # the routes that take a principal
# (a purge walks the cache on the engine thread and each tier: it counts against the rate limit as a request does)
METERED = CHARGED | {"/v1/cache/keys"}  # the routes whose bodies are read at the tenant's intake rate
GATED = {"/v1/chat/completions", "/v1/completions", "/v1/messages"}  # the routes that submit to the engine
REFUSAL_SECONDS = 1.0  # how long a 429 (529) refused from the headers takes: no sooner than its Retry-After allows


class Admission:
    """Authenticates a request to a METERED route and takes one request from its tenant's rate limit (CHARGED routes)
    from the headers alone, before the body is read: a bad credential is a 401 whatever the body, and a tenant over
    its limit, or over its part of the capacity (GATED routes), costs the server its headers, not the parsing of its
    body. The body is then read at the tenant's intake rate (server/intake.py). The caller goes on in the request's
    state (state.principal)."""

    def __init__(self, app, server):
        self.app, self.server = app, server  # server: state.Server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in METERED:
            return await self.app(scope, receive, send)
        intake = self.server.intake
        try:
            caller = self.server.auth(Request(scope))
            if scope["path"] in CHARGED:
                self.server.charge(caller)
            if scope["path"] in GATED:
                self.server.check_capacity(caller.tenant, api_of(scope["path"]))
            if not intake.begin(caller.tenant):
                raise ApiError(429, f"tenant {caller.tenant!r} has {intake.bound} request bodies being read; retry "
                                    "later", code="rate_limit_exceeded", retry_after=1)
        except ApiError as e:
            if e.status in (429, 529):  # a client that retries at once costs a request a second, not a busy loop
                await asyncio.sleep(REFUSAL_SECONDS)
            return await self.server.refusal(scope["path"], e)(scope, receive, send)
        scope.setdefault("state", {})["principal"] = caller
        reading = True

        async def metered():
            nonlocal reading
            message = await receive()
            if reading and message["type"] == "http.request":
                await intake.take(caller.tenant, len(message.get("body", b"")))
                if not message.get("more_body"):
                    reading = False
                    intake.end(caller.tenant)
            return message

        try:
            return await self.app(scope, metered, send)
        finally:
            if reading:
                intake.end(caller.tenant)


class MetricsPort:
    """On the metrics listener only GET /metrics is served, and without a key (the figures are server-wide, so the
    port belongs on the operators' network, as a NetworkPolicy keeps it); anything else there is a 404."""

    def __init__(self, app, port: int):
        self.app, self.port = app, port

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope.get("server") or (None, None))[1] != self.port:
            return await self.app(scope, receive, send)
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            return await self.app({**scope, METRICS_PORT: True}, receive, send)
        return await ApiError(404, "the metrics port serves GET /metrics only").openai()(scope, receive, send)


class BodyLimit:
    """Reads a request body up to `limit` bytes before the app sees it; past that, a 413 in the API's format.
    A Content-Length over the limit is refused before any of the body is read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        chunks, size, more = [], 0, int(declared) <= self.limit if declared.isdigit() else True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            more = more and size <= self.limit
        if size > self.limit or (declared.isdigit() and int(declared) > self.limit):
            e = ApiError(413, f"request body over {self.limit} bytes")
            response = e.anthropic() if scope["path"].startswith("/v1/messages") else e.openai()
            return await response(scope, receive, send)
        body = b"".join(chunks)

        async def replay():
            nonlocal body
            if body is None:
                return await receive()  # after the body: the client's disconnect, when it comes
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        await self.app(scope, replay, send)
