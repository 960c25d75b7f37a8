"""RouterConfig: the router's options and their defaults (the `route` command's flags derive from it)."""
from dataclasses import dataclass, field

from prefixcache.router.balance import Policy


@dataclass
class RouterConfig:
    replicas: list[str]  # base URLs, e.g. http://replica-1:8000
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None  # the replicas' KV event stream; None: route by load alone
    policy: Policy = field(default_factory=Policy)
    health_interval: float = 1.0  # seconds between health checks of every replica
    max_retries: int = 2  # further replicas tried when one fails before answering
    max_body_bytes: int = 1 << 20  # as the replicas' --max-body-bytes: larger bodies get 413 here
    max_model_len: int = 32768  # the replicas' context (tokens): a request's keys beyond it in blocks are not held
    max_pending_keys: int = 100_000  # routed requests' keys held before their events come, over all requests
    redis_password: str | None = field(default=None, repr=False)  # from a file or the environment (cli.py)
    admin_key: str | None = field(default=None, repr=False)  # an admin key of the replicas, for the health checks
