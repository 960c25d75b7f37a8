"""What the capacity planner predicts, measured: the hit rate a live server of ours (the real model, or `model`)
measures at each budget, driven by one user in the log's order (or its arrival times), with the tiers the plan had.
`prefixcache plan --validate` prints both."""
import os
import secrets
import tempfile

from prefixcache.bench.driver import Load, Target
from prefixcache.bench.plan import mib
from prefixcache.bench.report import Prices
from prefixcache.bench.runs import Bench, local, measure
from prefixcache.bench.server import RedisProcess, ServerOptions, Servers
from prefixcache.bench.workloads import Workload
from prefixcache.cache.credentials import TIER_SECRET_ENV


def measure_hit_rates(workload: Workload, budgets: list[int], min_cache_tokens: int = 0, seed: int = 0,
                      tiers: dict[str, int] | None = None, model: str = "", server_log: str | None = None
                      ) -> list[float | None]:
    """One live run per budget, on a fresh server whose cache is emptied first. Tiers: a folder of its own (L2)
    and a Redis of its own with `--maxmemory` the L3 size (L3)."""
    tiers = tiers or {}
    os.environ.setdefault(TIER_SECRET_ENV, secrets.token_hex(32))
    redis = RedisProcess(maxmemory=tiers["L3"]).start() if "L3" in tiers else None
    disk = tempfile.TemporaryDirectory(prefix="plan-l2-") if "L2" in tiers else None
    flags = ((("--disk-cache", disk.name, "--disk-cache-gb", str(tiers["L2"] / 2**30)) if disk else ()) +
             (("--redis-url", redis.url) if redis else ()) + (("--model", model) if model else ()))
    servers = Servers(workload.tenants, server_log)
    try:
        bench = Bench(Load(users=1, seed=seed), Prices(), ServerOptions(min_cache_tokens=min_cache_tokens,
                                                                        extra=flags), servers)
        out = []
        for budget in budgets:
            srv = local(bench, kv_cache_bytes=budget)
            s, _ = measure(workload, Target("live", srv.url, srv.keys), bench, f"live, {mib(budget)}", srv)
            out.append(s["hit_rate_tokens"])
        return out
    finally:
        servers.close()
        if redis:
            redis.stop()
        if disk:
            disk.cleanup()
