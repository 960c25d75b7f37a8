"""Routes shared by both APIs: health, models, version, metrics, the operator's usage page and cache purges."""
import asyncio
import importlib.metadata
import os

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from prefixcache.server.errors import ApiError
from prefixcache.server.middleware import METRICS_PORT
from prefixcache.server.state import current, principal

DASHBOARD = os.path.join(os.path.dirname(__file__), "dashboard.html")  # GET /dashboard

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """"degraded" when a KV tier is unreachable (requests still succeed: they recompute); "draining" (503)
    after SIGTERM. Probes and tenant keys get only that word: the load, replica id, tiers and exactness plan
    are server-wide, so with API keys only an admin key reads them, as /metrics (a missing or unknown key is no
    error here: probes send none); without keys the one tenant reads them all. The queue lengths are read
    without the engine thread, so a health check never waits for a step."""
    server = current(request)
    details = server.engine.health()
    tiers = details["tiers"]
    status = "draining" if server.draining else "ok" if all(t["status"] == "ok" for t in tiers.values()) \
        else "degraded"
    body = {"status": status, "model": server.model_name, **details}
    return JSONResponse(body if server.admin(request) else {"status": status}, 503 if server.draining else 200)


@router.get("/v1/models")
async def models(request: Request):
    server = current(request)
    server.auth(request)
    base = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "prefixcache",
            "max_model_len": server.engine.max_model_len}
    # LoRA adapters as vLLM lists them: each its own model, its parent the base
    return {"object": "list", "data": [base] + [{**base, "id": name, "parent": server.model_name}
                                                for name in server.engine.adapters]}


@router.get("/version")
async def version():
    return {"version": importlib.metadata.version("prefixcache")}


@router.get("/metrics")
async def metrics(request: Request):
    """Server-wide figures move with every tenant's requests (hits, misses by cause, KV usage, evictions),
    so with API keys only an admin key may read them."""
    server = current(request)
    if not (request.scope.get(METRICS_PORT) or server.auth(request).admin):
        raise ApiError(403, "/metrics needs an admin key", code="permission_denied")
    stats = await server.worker.call(lambda e: e.stats())
    return Response(server.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cache/usage")
async def cache_usage(request: Request):
    """Per-tenant figures and the most reused prefixes, for the operator's page (admin only)."""
    server = current(request)
    if not server.auth(request).admin:
        raise ApiError(403, "/v1/cache/usage needs an admin key", code="permission_denied")
    return JSONResponse(await server.worker.call(lambda e: e.cache.usage()))


@router.get("/dashboard")
async def dashboard():
    """The operator's live page: static; it reads /metrics and /v1/cache/usage with the admin key it is given."""
    return FileResponse(DASHBOARD, media_type="text/html")


@router.delete("/v1/cache")
async def purge(request: Request):
    """An admin key clears the whole cache; any other key purges its own tenant and labels (every salt). A purge
    is charged to the tenant's rate limit (middleware.CHARGED), and purges of one owner that arrive while one of its
    purges runs share that one: a flood of them walks the cache once."""
    server = current(request)
    p = principal(request)
    owner = None if p.admin else (p.tenant, p.labels)
    running = server.purges.get(owner)
    if running is None:
        work = (lambda e: e.cache.clear()) if p.admin else (lambda e: e.cache.purge_tenant(p.tenant, p.labels))
        running = server.purges[owner] = asyncio.ensure_future(server.worker.call(work))
        running.add_done_callback(lambda _: server.purges.pop(owner, None))
    freed = await asyncio.shield(running)
    if p.admin:
        return JSONResponse({"purged_blocks": freed, "scope": "all"})
    return JSONResponse({"purged_blocks": freed, "scope": "tenant", "tenant": p.tenant})
