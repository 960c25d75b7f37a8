"""One measured run (driver + /metrics poller + progress bar), the cache-on-vs-off pair, and multi-target compare."""
import asyncio
from dataclasses import dataclass, replace

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefixcache.bench.driver import Load, Result, Target, run
from prefixcache.bench.report import Prices, goodput, summarize
from prefixcache.bench.server import ADMIN_KEY, LocalServer, MetricsPoller, ServerOptions, Servers
from prefixcache.bench.workloads import Session, Turn, Workload
from prefixcache.slo import Objectives

WARMUP = Workload("warmup", [Session([Turn([{"role": "user", "content": "Say hello."}], 2)])])


@dataclass
class Bench:
    """What every run in one invocation shares."""

    load: Load
    prices: Prices
    server: ServerOptions  # for the servers started here; sweeps and on/off vary some fields
    servers: Servers
    objectives: Objectives | None = None  # --goodput: every run reports goodput and attainment


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def measure(workload: Workload, target: Target, bench: Bench, label: str,
            server: LocalServer | None = None, load: Load | None = None) -> tuple[dict, list[Result]]:
    """Warm the server up with one tiny request, empty its cache, then drive the workload and summarize it."""
    load = load or bench.load

    async def go():
        await run(WARMUP, target, Load(users=1))
        if server:
            server.empty_cache()
        with progress() as bar:
            task = bar.add_task(f"{workload.name} ({label})", total=workload.num_requests)
            auth = {"Authorization": f"Bearer {ADMIN_KEY}"} if server else {}  # /metrics is for admins
            async with MetricsPoller(target.url, auth) as poller:
                results, wall = await run(workload, target, load, lambda r: bar.advance(task))
        return results, wall, poller.summary()

    results, wall, stats = asyncio.run(go())
    extra = {**(stats or {}), **(server.rss_mb() if server else {})}
    if bench.objectives:
        extra.update(goodput(results, wall, bench.objectives))
    return summarize(results, wall, bench.prices, extra), results


def local(bench: Bench, **changes) -> LocalServer:
    return bench.servers.get(replace(bench.server, **changes))


def on_off(workload: Workload, bench: Bench) -> dict[str, dict]:
    """The same workload against a fresh server with the prefix cache on, then off."""
    columns = {}
    for label, cache in (("cache on", True), ("cache off", False)):
        srv = local(bench, prefix_cache=cache)
        columns[label], _ = measure(workload, Target(label, srv.url, srv.keys), bench, label, srv)
    return columns


def compare(workload: Workload, targets: list[tuple[str, str]], bench: Bench) -> dict[str, dict]:
    """One workload against each target in turn."""
    columns = {}
    for name, url in targets:
        t, srv = target(name, url, bench)
        columns[name], _ = measure(workload, t, bench, name, srv)
    return columns


def target(name: str, url: str, bench: Bench) -> tuple[Target, LocalServer | None]:
    """A --target: a URL of `local`, `local-nocache`, `local-spec`, `local-unpaced` (the objectives only counted,
    --no-slo-schedule) or `hf` starts that server here."""
    if url in ("local", "local-nocache", "local-spec", "local-unpaced", "hf"):
        srv = local(bench, prefix_cache=url != "local-nocache", kind="hf" if url == "hf" else "prefixcache",
                    speculative="both" if url == "local-spec" else "off",
                    extra=(*bench.server.extra, "--no-slo-schedule") if url == "local-unpaced" else bench.server.extra)
        return Target(name, srv.url, srv.keys), srv
    return Target(name, url.rstrip("/")), None
