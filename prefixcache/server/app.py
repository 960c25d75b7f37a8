"""The FastAPI app: the Server, the ASGI layers, every route, and errors in each API's own format.

Model names: a request may name the served model (e.g. "SmolLM2-135M-Instruct.Q4_1") or "default"; anything
else is a 404 in that API's format.
"""
import asyncio
import signal
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from prefixcache.server import admin, anthropic, cache_keys, openai, tokens
from prefixcache.server.config import ServeConfig
from prefixcache.server.errors import ApiError, invalid
from prefixcache.server.middleware import Admission, BodyLimit, MetricsPort
from prefixcache.server.oidc import OidcConfig, OidcVerifier
from prefixcache.server.state import Server, load_engine
from prefixcache.server.worker import EngineWorker


def create_app(cfg: ServeConfig) -> FastAPI:
    # a bad OIDC config fails here, before the model loads
    oidc = OidcVerifier(OidcConfig.read(cfg.auth_oidc), cfg.auth_oidc) if cfg.auth_oidc else None
    server = Server(cfg, EngineWorker(lambda: load_engine(cfg), cfg.stream_stall_timeout), oidc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        server.worker.start(loop)
        server.apply_shares()
        if server.keys and threading.current_thread() is threading.main_thread():  # signals reach the main thread
            loop.add_signal_handler(signal.SIGHUP, server.reload_keys)
        yield
        server.worker.stop()
        server.preparer.shutdown()

    app = FastAPI(title="prefixcache", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_middleware(Admission, server=server)  # outside the body limit: it runs first
    if cfg.metrics_port:
        app.add_middleware(MetricsPort, port=cfg.metrics_port)
    app.include_router(admin.router)
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
        return server.refusal(request.url.path, e)

    return app
