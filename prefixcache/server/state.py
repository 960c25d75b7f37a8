"""The Server: what every route shares (the engine worker, keys, metrics, limits) and the admission of a request.

Routes reach it through `current(request)`, typed; a Generation gets from it only what it uses.
"""
import asyncio
import json
import logging
from typing import Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from prefixcache.cache.fair import FairThread
from prefixcache.cache.policy import Breakpoint
from prefixcache.engine.engine import Engine
from prefixcache.engine.sequence import SamplingParams
from prefixcache.prompt import encode_system
from prefixcache.server.auth import Keys, authenticate
from prefixcache.server.config import ServeConfig
from prefixcache.server.errors import ApiError, api_of
from prefixcache.server.gate import admits
from prefixcache.server.generation import CLIENT_CLOSED, Generation
from prefixcache.server.intake import Intake
from prefixcache.server.limits import RateLimits
from prefixcache.server.metrics import Metrics
from prefixcache.server.oidc import OidcVerifier
from prefixcache.server.principal import Principal
from prefixcache.server.worker import EngineWorker

log = logging.getLogger("prefixcache.request")

MODEL_ALIAS = "default"
# a quarter of a core still tokenizes some 50,000 prompt tokens a second, more than the engine prefills on any core
PREPARE_DUTY = 0.25
T = TypeVar("T")


def load_engine(cfg: ServeConfig) -> Engine:
    config = cfg.engine
    if cfg.shared_prefixes:
        # the prefixes are token ids, so the tokenizer is needed before the engine exists
        from prefixcache.models.catalog import model_path
        from prefixcache.models.loader import tokenizer
        with open(cfg.shared_prefixes) as f:
            texts = json.load(f)
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{cfg.shared_prefixes}: expected a JSON list of system-prompt strings")
        tok = tokenizer(model_path(config.model))
        config.shared_prefixes = [encode_system(tok, t) for t in texts]
    engine = Engine(config)
    if engine.exactness.mode != "kernel" and not cfg.allow_torch_path:
        engine.close()
        raise ValueError(f"our kernels do not run here ({engine.exactness.kernels}), and the torch path decodes 4-5x "
                         "slower: build them (`make setup`, or `python -m prefixcache.kernels.build` where g++ is), or "
                         "pass --allow-torch-path to serve on the torch path")
    return engine


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
        self.shares: dict[str, float] = {}  # tenant -> cache_share: its weight at the admission gate and in the engine
        # rendering and tokenizing, off the event loop (the tokenizer lets go of the GIL), taken by tenant weight; one
        # tenant may have as many requests waiting there as the server holds in flight, then 429. A tenant's jobs take
        # at most PREPARE_DUTY of a thread's time: its core is one the engine's threads run on. Two threads, a
        # tenant's jobs one at a time: another tenant's short request never waits for a long prompt's tokenizing
        self.capacity = cfg.engine.max_num_seqs + cfg.max_queue  # requests in flight (server/gate.py)
        self.preparer = FairThread("prepare", self.capacity, duty=PREPARE_DUTY, workers=2)
        self.intake = Intake(cfg.intake_bytes_per_s, cfg.max_body_bytes, self.capacity)
        self.draining = False  # after SIGTERM: running requests finish, new ones get 503 (server/serve.py)
        self.purges: dict = {}  # owner (None: all) -> its purge under way, which later purges of it share

    def reload_keys(self) -> None:
        """SIGHUP: read the keys file again, with the tenants' cache shares."""
        self.keys.reload()
        self.apply_shares()

    def apply_shares(self) -> None:
        if self.keys:
            self.shares = shares = self.keys.shares()
            self.preparer.set_shares(shares)
            self.worker.inbox.put(lambda: self.engine.cache.set_shares(shares))

    def auth(self, request: Request) -> Principal:
        return authenticate(self.keys, request.headers, self.oidc)

    def refusal(self, path: str, e: ApiError) -> JSONResponse:
        """An error in the format of the API at `path`, counted and logged."""
        api = api_of(path)
        self.metrics.status(api, e.status)
        log.info(json.dumps({"api": api, "path": path, "status": e.status, "error": e.message}))
        return e.anthropic() if api == "anthropic" else e.openai()

    def check_capacity(self, tenant: str, api: str) -> None:
        """The admission gate (server/gate.py): a 429 (529 on Anthropic's API) if the tenant's request may not enter.
        Asked from the headers too (middleware.Admission), so a tenant over its part costs no parsing or tokenizing."""
        if not admits(self.worker.held, tenant, self.shares, self.capacity):
            raise ApiError(529 if api == "anthropic" else 429, "server is over capacity; retry later", retry_after=1)

    def check_context(self, prompt: list[int], param: str = "messages") -> None:
        if len(prompt) >= self.engine.max_model_len:
            raise ApiError(400, f"prompt has {len(prompt)} tokens; the context window is {self.engine.max_model_len}",
                           param=param, code="context_length_exceeded")

    async def prepare(self, principal: Principal, fn: Callable[[], T]) -> T:
        """fn() (a request's rendering, tokenizing and sampling parameters) on the preparing thread, in its tenant's
        turn; a 429 if the tenant already has as many requests waiting there as the server holds in flight."""
        future = self.preparer.submit(principal.tenant, fn)
        if future is None:
            raise ApiError(429, f"tenant {principal.tenant!r} has {self.preparer.jobs.bound} requests waiting to be "
                                "tokenized; retry later", code="rate_limit_exceeded", retry_after=1)
        return await asyncio.wrap_future(future)

    def charge(self, principal: Principal, tokens: int = 0) -> None:
        """Take a request (tokens=0), or prompt tokens, from the tenant's rate limit; a 429 if they do not fit."""
        kind, limit, n = ("tokens", principal.tpm, tokens) if tokens else ("requests", principal.rpm, 1)
        wait = self.limits.take(principal.tenant, kind, limit, n)
        if wait:
            raise ApiError(429, f"rate limit of tenant {principal.tenant!r} reached; retry in {wait} s",
                           code="rate_limit_exceeded", retry_after=wait)

    def admin(self, request: Request) -> bool:
        """Whether the caller holds an admin key (always so without keys); a missing or unknown key is no error."""
        try:
            return self.auth(request).admin
        except ApiError:
            return False

    def check_model(self, model: str) -> str:
        """The LoRA adapter a request's model names ("" for the base model); a 404 for a model not served."""
        if model in self.engine.adapters:
            return model
        if model not in (self.model_name, MODEL_ALIAS):
            adapters = "".join(f", {a!r}" for a in self.engine.adapters)
            raise ApiError(404, f"model {model!r} not found; this server serves {self.model_name!r} "
                                f"(alias {MODEL_ALIAS!r}){adapters}", param="model", code="model_not_found")
        return ""

    async def generate(self, request: Request, api: str, principal: Principal, prompt: list[int],
                       params: SamplingParams, salt: str = "", breakpoints: list[Breakpoint] = (),
                       where: Callable[[int], str] | None = None, adapter: str = "") -> Generation:
        """Submit a validated request and wait for its first token. `where` maps a token position back to the
        request (message and character offset), to explain where a cache match stopped."""
        if self.draining:
            raise ApiError(503, "server is shutting down; retry on another replica", retry_after=1)
        self.check_context(prompt)
        self.charge(principal, len(prompt))
        self.check_capacity(principal.tenant, api)
        handle = self.worker.submit(prompt, params, principal.scope(salt), list(breakpoints), adapter)
        gen = None
        try:
            gen = Generation(self.worker, self.metrics, handle, api, principal.tenant, params, where,
                             self.cfg.engine.log_cross_scope_misses)
            await gen.start(request)
        except BaseException:  # refused, failed or cancelled: its place in flight goes back (once)
            if gen is None:
                self.worker.finished(handle)
            else:
                gen.close(CLIENT_CLOSED)
            raise
        return gen


def current(request: Request) -> Server:
    """The app's Server (create_app puts it there)."""
    return request.app.state.server


def authenticated(request: Request) -> Principal:
    """FastAPI dependency: the caller, from its API key or identity token (resolved before the body is validated,
    so a bad credential is a 401 whatever the body)."""
    return current(request).auth(request)


def principal(request: Request) -> Principal:
    """FastAPI dependency: the caller, authenticated and charged one request of its rate limit by the Admission layer
    before the body was read (so a request refused for its body is charged too)."""
    caller = getattr(request.state, "principal", None)
    assert caller is not None, f"{request.url.path} takes a principal: it belongs in middleware.CHARGED"
    return caller
