"""The router's Prometheus metrics, in its own CollectorRegistry. Counters are observed per request; replica
health, load and indexed blocks are read from the router's state at scrape time."""
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from prefixcache.router.index import PrefixIndex
from prefixcache.router.replicas import Replica


class ReplicaCollector:
    def __init__(self, replicas: list[Replica], index: PrefixIndex | None):
        self.replicas, self.index = replicas, index

    def collect(self):
        gauges = [("replica_healthy", "1 while the replica is in rotation", lambda r: int(r.healthy)),
                  ("replica_load", "The replica's load as the router counts it (the larger of its requests in flight "
                   "from here and its own running and waiting)", lambda r: r.load)]
        if self.index:
            gauges.append(("indexed_blocks", "Cache blocks the replica holds, from its KV events",
                           lambda r: self.index.blocks(r.replica_id)))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"prefixcache_router:{name}", doc, labels=["replica"])
            for r in self.replicas:
                g.add_metric([r.url], value(r))
            yield g


class RouterMetrics:
    def __init__(self, replicas: list[Replica], index: PrefixIndex | None):
        self.registry = CollectorRegistry()
        self.registry.register(ReplicaCollector(replicas, index))
        kw = dict(labelnames=["replica"], registry=self.registry)
        self.requests = Counter("prefixcache_router:requests", "Requests answered, by the replica that answered", **kw)
        self.retries = Counter("prefixcache_router:retries", "Attempts that failed before any of the response was "
                               "sent on (tried again elsewhere while retries and replicas remain), by the replica "
                               "that failed", **kw)
        self.decisions = Counter("prefixcache_router:decisions", "Replica choices, by reason: cache (longest cached "
                                 "prefix), load (least loaded), balance (load uneven)", labelnames=["reason"],
                                 registry=self.registry)
        self.predicted = Counter("prefixcache_router:predicted_cached_tokens", "Prompt tokens the index predicted "
                                 "cached at the chosen replica, for responses that report usage", **kw)
        self.cached = Counter("prefixcache_router:cached_tokens", "Prompt tokens the replica reported cached "
                              "(same responses as predicted_cached_tokens)", **kw)

    def usage(self, replica: str, predicted: int, cached: int | None) -> None:
        """Predicted and actual cached tokens of one response, counted only when the response reported them."""
        if cached is not None:
            self.predicted.labels(replica).inc(predicted)
            self.cached.labels(replica).inc(cached)

    def render(self) -> bytes:
        return generate_latest(self.registry)
