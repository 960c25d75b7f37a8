"""The router's FastAPI app: the three completion routes proxied to replicas, its own /health and /metrics.

Per request: the block keys of the request (from any healthy replica's /v1/cache/keys, with the client's own key,
so the tenant is always the replica's decision), each healthy replica's match in the index of KV events and its
load, the choice (router/balance.py), the forward (router/proxy.py).
"""
import asyncio
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from prefixcache.router.config import RouterConfig
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.proxy import AUTH_HEADERS, Router
from prefixcache.router.replicas import HEALTH_TIMEOUT, HealthChecker, Replica
from prefixcache.server.errors import ApiError
from prefixcache.server.middleware import BodyLimit

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages")


def create_app(cfg: RouterConfig) -> FastAPI:
    replicas = [Replica(url.rstrip("/")) for url in cfg.replicas]
    index = PrefixIndex(cfg.redis_url, cfg.redis_password, max_pending=cfg.max_pending_keys) if cfg.redis_url else None
    metrics = RouterMetrics(replicas, index)
    router = Router(replicas, index, cfg.policy, cfg.max_retries, metrics, cfg.max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # no read timeout: a long generation is not a failure; a dead replica is a connection error
        timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            router.client = client
            health = HealthChecker(replicas, client, cfg.health_interval, cfg.admin_key, index)
            await health.check_all()
            tasks = [asyncio.create_task(health.run())]
            if index:
                tasks.append(asyncio.create_task(index.follow()))
            yield
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="prefixcache router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.anthropic() if request.url.path.startswith("/v1/messages") else e.openai()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown paths and methods
        return await api_error(request, ApiError(e.status_code, str(e.detail)))

    async def proxy(request: Request) -> Response:
        return await router.forward(request)

    for path in ROUTES:
        app.add_api_route(path, proxy, methods=["POST"])

    @app.get("/health")
    async def health(request: Request):
        """"ok" while a replica is healthy, else "degraded" (503). The replicas' state goes only to a caller whose
        key a healthy replica's own /health answers in detail (an admin key; anyone when the replicas run without
        keys)."""
        up = router.healthy()
        body = {"status": "ok" if up else "degraded"}
        if up and await detailed(request, up[0]):
            body |= {"healthy": len(up), "replicas": [r.describe() for r in replicas]}
        return JSONResponse(body, 200 if up else 503)

    async def detailed(request: Request, replica: Replica) -> bool:
        """Whether the replica's /health answers the caller's key with its details."""
        try:
            r = await router.client.get(f"{replica.url}/health", headers=passed_key(request), timeout=HEALTH_TIMEOUT)
            return "replica_id" in r.json()
        except (httpx.HTTPError, ValueError, TypeError):
            return False

    async def ask_replica(request: Request, path: str) -> httpx.Response:
        """A GET of `path` on a healthy replica with the caller's key."""
        up = router.healthy()
        if not up:
            raise ApiError(503, "no healthy replica", retry_after=1)
        try:
            return await router.client.get(f"{up[0].url}{path}", headers=passed_key(request))
        except httpx.HTTPError:
            raise ApiError(503, "the replica asked did not answer", retry_after=1)

    @app.get("/v1/models")
    async def models(request: Request):
        r = await ask_replica(request, "/v1/models")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/metrics")
    async def metrics_route(request: Request):
        """Per-replica cache figures move with every tenant's requests, so the router shows them only to a key
        that a replica's own /metrics accepts (an admin key; anyone when the replicas run without keys)."""
        r = await ask_replica(request, "/metrics")
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def passed_key(request: Request) -> dict[str, str]:
    """The caller's API key headers, to pass on to a replica."""
    return {h: request.headers[h] for h in AUTH_HEADERS if h in request.headers}
