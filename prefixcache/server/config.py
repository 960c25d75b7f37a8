"""The server's own options (ServeConfig); the engine's are its Config."""
from dataclasses import dataclass, field, fields

from prefixcache.config import Config
from prefixcache.slo import Objectives


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
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before they are read further (a body is parsed on
    # the event loop, about 12 ms a MiB here: with a larger cap one tenant's stream of big bodies stalls every stream)
    intake_bytes_per_s: int = 4 << 20  # bytes of a tenant's request bodies read a second; 0: no limit
    # (server/intake.py: parsing a body holds the GIL, which every engine step needs back after each kernel)
    stream_stall_timeout: float = 30.0  # seconds a stream's updates may wait unread (its client not reading)
    # before the request is aborted and its memory freed; the engine never waits on a client
    grace_seconds: float = 30.0  # on SIGTERM: new requests get 503; running ones get this long to finish
    metrics_port: int | None = None  # a listener for GET /metrics alone, without a key (server/serve.py)
    allow_torch_path: bool = False  # serve where our kernels cannot run (not built, the CPU, the options, a failed
    # startup check): torch's path decodes 4-5x slower; without it such a replica refuses to start

    def objectives(self) -> Objectives:
        """The engine's latency objectives, which /metrics counts against."""
        e = self.engine
        return Objectives(ttft=e.slo_ttft_ms and e.slo_ttft_ms / 1000, tpot=e.slo_tpot_ms and e.slo_tpot_ms / 1000)


SERVE_OPTIONS = tuple(f.name for f in fields(ServeConfig) if f.name != "engine")
