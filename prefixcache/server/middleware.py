"""The ASGI layers in front of both APIs: the request body limit, and the metrics port's one route."""
from prefixcache.server.errors import ApiError

METRICS_PORT = "prefixcache.metrics_port"  # in a request's scope: it came in on --metrics-port


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
