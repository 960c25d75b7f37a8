"""The FastAPI app: routes shared by both APIs (health, models, metrics, cache admin) and the Server state.

Model names: a request may name the served model (e.g. "SmolLM2-135M-Instruct.Q4_1") or "default"; anything
else is a 404 in that API's format.
"""
import asyncio
import importlib.metadata
import json
import logging
import os
import signal
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from prefixcache.cache.policy import Breakpoint
from prefixcache.config import Config
from prefixcache.engine.engine import Engine
from prefixcache.engine.sequence import SamplingParams
from prefixcache.prompt import encode_system
from prefixcache.server.auth import Keys, authenticate
from prefixcache.server.errors import ApiError, invalid
from prefixcache.server.generation import Generation
from prefixcache.server.limits import RateLimits
from prefixcache.server.metrics import Metrics
from prefixcache.server.oidc import OidcConfig, OidcVerifier
from prefixcache.server.principal import Principal
from prefixcache.server.worker import EngineWorker
from prefixcache.slo import Objectives, positive_ms

MODEL_ALIAS = "default"

log = logging.getLogger("prefixcache.request")
DASHBOARD = os.path.join(os.path.dirname(__file__), "dashboard.html")  # GET /dashboard


@dataclass
class ServeConfig:
    """The server's own options; the engine's are its Config."""

    engine: Config = field(default_factory=Config)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: str | None = None  # JSON key file; None: one local tenant, no auth
    auth_oidc: str | None = None  # OIDC config file: tenants and labels from identity tokens (server/oidc.py)
    shared_prefixes: str | None = None  # JSON list of system-prompt strings shared by all tenants
    max_queue: int = 64  # waiting requests beyond the running batch; past it, 429 / 529
    max_body_bytes: int = 4 << 20  # larger request bodies get 413 before they are read further
    grace_seconds: float = 30.0  # on SIGTERM: new requests get 503; running ones get this long to finish
    metrics_port: int | None = None  # a listener for GET /metrics alone, without a key (server/serve.py)
    slo_ttft_ms: float | None = None  # objectives: /metrics counts the requests that met and missed each
    slo_tpot_ms: float | None = None

    def objectives(self) -> Objectives:
        """The server's latency objectives; a ValueError names the one that is not a positive number."""
        given = {name: positive_ms(str(ms), f"--slo-{name}-ms")
                 for name, ms in (("ttft", self.slo_ttft_ms), ("tpot", self.slo_tpot_ms)) if ms is not None}
        return Objectives(**given)


SERVE_OPTIONS = tuple(f.name for f in fields(ServeConfig) if f.name != "engine")


def load_engine(cfg: ServeConfig) -> Engine:
    config = cfg.engine
    if cfg.shared_prefixes:
        # the prefixes are token ids, so the tokenizer is needed before the engine exists
        from transformers import AutoTokenizer

        from prefixcache.models.loader import converted_folder
        with open(cfg.shared_prefixes) as f:
            texts = json.load(f)
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{cfg.shared_prefixes}: expected a JSON list of system-prompt strings")
        folder = config.model if os.path.isdir(config.model) else converted_folder(config.model)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        config.shared_prefixes = [encode_system(tokenizer, t) for t in texts]
    return Engine(config)


class Server:
    def __init__(self, cfg: ServeConfig, worker: EngineWorker, oidc: OidcVerifier | None = None):
        self.cfg = cfg
        self.worker = worker  # attached to the event loop when the app starts
        self.engine = engine = worker.engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.keys = Keys(cfg.api_keys) if cfg.api_keys else None
        self.oidc = oidc
        self.metrics = Metrics(engine.model_name, engine.max_model_len, {
            "block_size": str(engine.config.block_size), "cache_dtype": str(engine.pool.k.dtype).removeprefix("torch."),
            "enable_prefix_caching": str(engine.config.enable_prefix_cache),
            "num_gpu_blocks": str(engine.pool.usable_blocks)}, cfg.objectives())
        self.limits = RateLimits()
        self.draining = False  # after SIGTERM: running requests finish, new ones get 503 (server/serve.py)

    def reload_keys(self) -> None:
        """SIGHUP: read the keys file again, with the tenants' cache shares."""
        self.keys.reload()
        self.apply_shares()

    def apply_shares(self) -> None:
        if self.keys:
            shares = self.keys.shares()
            self.worker.inbox.put(lambda: self.engine.set_cache_shares(shares))

    def auth(self, request: Request) -> Principal:
        return authenticate(self.keys, request.headers, self.oidc)

    def admin(self, request: Request) -> bool:
        """Whether the caller holds an admin key (always so without keys); a missing or unknown key is no error."""
        try:
            return self.auth(request).admin
        except ApiError:
            return False

    def check_model(self, model: str) -> None:
        if model not in (self.model_name, MODEL_ALIAS):
            raise ApiError(404, f"model {model!r} not found; this server serves {self.model_name!r} "
                                f"(alias {MODEL_ALIAS!r})", param="model", code="model_not_found")

    async def generate(self, request: Request, api: str, principal: Principal, prompt: list[int],
                       params: SamplingParams, salt: str = "", breakpoints: list[Breakpoint] = (),
                       where: Callable[[int], str] | None = None) -> Generation:
        """Submit a validated request and wait for its first token. `where` maps a token position back to the
        request (message and character offset), to explain where a cache match stopped."""
        if self.draining:
            raise ApiError(503, "server is shutting down; retry on another replica", retry_after=1)
        if len(prompt) >= self.engine.max_model_len:
            raise ApiError(400, f"prompt has {len(prompt)} tokens; the context window is {self.engine.max_model_len}",
                           param="messages", code="context_length_exceeded")
        if self.worker.in_flight >= self.cfg.engine.max_num_seqs + self.cfg.max_queue:
            raise ApiError(529 if api == "anthropic" else 429, "server is over capacity; retry later", retry_after=1)
        if wait := self.limits.admit(principal.tenant, principal.rpm, principal.tpm, len(prompt)):
            raise ApiError(429, f"rate limit of tenant {principal.tenant!r} reached; retry in {wait} s",
                           code="rate_limit_exceeded", retry_after=wait)
        scope = principal.scope(salt)
        gen = Generation(self, self.worker.submit(prompt, params, scope, list(breakpoints)), api, principal.tenant,
                         params, where)
        await gen.start(request)
        return gen


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


def create_app(cfg: ServeConfig) -> FastAPI:
    from prefixcache.server import anthropic, cache_keys, openai, tokens

    cfg.objectives()  # a bad objective or OIDC config fails before the model loads
    oidc = OidcVerifier(OidcConfig.read(cfg.auth_oidc), cfg.auth_oidc) if cfg.auth_oidc else None
    server = Server(cfg, EngineWorker(lambda: load_engine(cfg)), oidc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        server.worker.start(loop)
        server.apply_shares()
        if server.keys and threading.current_thread() is threading.main_thread():  # signals reach the main thread
            loop.add_signal_handler(signal.SIGHUP, server.reload_keys)
        yield
        server.worker.stop()

    app = FastAPI(title="prefixcache", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    if cfg.metrics_port:
        app.add_middleware(MetricsPort, port=cfg.metrics_port)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(tokens.router)
    app.include_router(cache_keys.router)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        return await api_error(request, invalid(e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unparsable bodies, unknown paths and methods
        return await api_error(request, ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):  # a fault of ours: a 500 in the API's format (Starlette logs it)
        return await api_error(request, ApiError(500, f"internal error: {type(e).__name__}"))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        api = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
        server.metrics.status(api, e.status)
        log.info(json.dumps({"api": api, "path": request.url.path, "status": e.status, "error": e.message}))
        return e.anthropic() if api == "anthropic" else e.openai()

    @app.get("/health")
    async def health(request: Request):
        """"degraded" when a KV tier is unreachable (requests still succeed: they recompute); "draining" (503)
        after SIGTERM. Probes and tenant keys get only that word: the load, replica id, tiers and exactness plan
        are server-wide, so with API keys only an admin key reads them, as /metrics (a missing or unknown key is no
        error here: probes send none); without keys the one tenant reads them all. The queue lengths are read
        without the engine thread, so a health check never waits for a step."""
        engine = server.engine
        pool = engine.pool
        tiers = engine.blocks.tiering.tiers.health() if engine.blocks.tiering else {}
        status = "draining" if server.draining else "ok" if all(t["status"] == "ok" for t in tiers.values()) \
            else "degraded"
        body = {"status": status, "model": server.model_name, "replica_id": engine.replica_id,
                "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting), "tiers": tiers,
                "kv_bytes_per_token": pool.block_bytes // pool.block_size, "exactness": engine.exactness.summary()}
        return JSONResponse(body if server.admin(request) else {"status": status}, 503 if server.draining else 200)

    @app.get("/v1/models")
    async def models(request: Request):
        server.auth(request)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "prefixcache", "max_model_len": server.engine.max_model_len}]}

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("prefixcache")}

    @app.get("/metrics")
    async def metrics(request: Request):
        """Server-wide figures move with every tenant's requests (hits, misses by cause, KV usage, evictions),
        so with API keys only an admin key may read them."""
        if not (request.scope.get(METRICS_PORT) or server.auth(request).admin):
            raise ApiError(403, "/metrics needs an admin key", code="permission_denied")
        stats = await server.worker.call(lambda e: e.stats())
        return Response(server.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/cache/usage")
    async def cache_usage(request: Request):
        """Per-tenant figures and the most reused prefixes, for the operator's page (admin only)."""
        if not server.auth(request).admin:
            raise ApiError(403, "/v1/cache/usage needs an admin key", code="permission_denied")
        return JSONResponse(await server.worker.call(lambda e: e.usage()))

    @app.get("/dashboard")
    async def dashboard():
        """The operator's live page: static; it reads /metrics and /v1/cache/usage with the admin key it is given."""
        return FileResponse(DASHBOARD, media_type="text/html")

    @app.delete("/v1/cache")
    async def purge(request: Request):
        """An admin key clears the whole cache; any other key purges its own tenant and labels (every salt)."""
        p = server.auth(request)
        if p.admin:
            freed = await server.worker.call(lambda e: e.clear_cache())
            return JSONResponse({"purged_blocks": freed, "scope": "all"})
        freed = await server.worker.call(lambda e: e.purge_tenant(p.tenant, p.labels))
        return JSONResponse({"purged_blocks": freed, "scope": "tenant", "tenant": p.tenant})

    return app
