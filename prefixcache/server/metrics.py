"""Prometheus metrics with vLLM-style names, one CollectorRegistry per app.

Per-request histograms and counters are observed when a request ends. Engine state (cache queries and hits,
KV usage, evictions, queue depth) is read from an engine.stats() snapshot taken on the engine thread at
scrape time, and exported by a collector, so the counters are the engine's own.
"""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixcache.engine.sequence import RequestOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict = {}

    def collect(self):
        s, labels = self.stats, [self.model_name]
        if not s:
            return
        for name, doc, value in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  s["query_tokens"]),
                                 ("prefix_cache_hits", "Prompt tokens served from the prefix cache", s["hit_tokens"])):
            c = CounterMetricFamily(f"prefixcache:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c
        ev = CounterMetricFamily("prefixcache:cache_evictions", "Cache blocks removed, by reason",
                                 labels=["model_name", "reason"])
        for reason, n in s["evictions"].items():
            ev.add_metric(labels + [reason], n)
        yield ev
        pre = CounterMetricFamily("prefixcache:num_preemptions", "Running requests preempted for memory (recomputed "
                                  "later)", labels=["model_name"])
        pre.add_metric(labels, s["preemptions"])
        yield pre
        for name, doc in (("drafts", "Speculative drafts verified"), ("draft_tokens", "Draft tokens verified"),
                          ("accepted_tokens", "Draft tokens accepted (output tokens that skipped a decode step)")):
            c = CounterMetricFamily(f"prefixcache:spec_decode_num_{name}", doc, labels=["model_name"])
            c.add_metric(labels, s[f"spec_{name}"])
            yield c
        yield from _tiers(s.get("tiers"), labels)
        for name, doc, value in (("kv_cache_usage_perc", "Fraction of KV blocks in use (live or cached)",
                                  s["occupancy_perc"] / 100),
                                 ("num_requests_waiting", "Requests waiting for admission", s["waiting"]),
                                 ("num_requests_running", "Requests being prefilled or decoded", s["running"])):
            g = GaugeMetricFamily(f"prefixcache:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g


def _tiers(t: dict | None, labels: list[str]):
    """The KV tiers below host memory (L2 disk, L3 Redis) and the KV event stream, if configured."""
    if not t:
        return
    c = t["counts"]
    tiers = sorted(t["health"])
    specs = (("kv_tier_lookups", "Blocks looked up in a KV tier, by result (bad: corrupt or mismatched, deleted "
              "and recomputed)", "result", {"hit": "hits", "miss": "misses", "bad": "bad"}),
             ("kv_tier_writes", "Blocks written to a KV tier, by result (dropped: the write queue was full)", "result",
              {"ok": "writes", "error": "write_errors", "dropped": "writes_dropped"}),
             ("kv_tier_bytes", "Bytes moved to and from a KV tier", "direction",
              {"read": "bytes_read", "written": "bytes_written"}))
    for name, doc, label, parts in specs:
        m = CounterMetricFamily(f"prefixcache:{name}", doc, labels=["model_name", "tier", label])
        for tier in tiers:
            for value, key in parts.items():
                m.add_metric(labels + [tier, value], c.get(f"{tier}_{key}", 0))
        yield m
    m = CounterMetricFamily("prefixcache:kv_tier_read_seconds", "Time spent reading a KV tier (L3: round trips)",
                            labels=["model_name", "tier"])
    up = GaugeMetricFamily("prefixcache:kv_tier_up", "1 if a KV tier is reachable (0: its circuit breaker is open)",
                           labels=["model_name", "tier"])
    for tier in tiers:
        m.add_metric(labels + [tier], c.get(f"{tier}_read_seconds", 0.0))
        up.add_metric(labels + [tier], float(t["health"][tier]["status"] == "ok"))
    yield m
    yield up
    if "events" in t:
        ev = CounterMetricFamily("prefixcache:kv_events", "KV event batches published, by result",
                                 labels=["model_name", "result"])
        for result, n in t["events"].items():
            ev.add_metric(labels + [result], n)
        yield ev


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model_name)
        self.registry.register(self.engine)
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("prefixcache:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              **kw)
        self.e2e = Histogram("prefixcache:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, **kw)
        self.itl = Histogram("prefixcache:inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, **kw)
        self.success = Counter("prefixcache:request_success", "Finished requests, by finish reason",
                               labelnames=["model_name", "finish_reason"], registry=self.registry)
        self.misses = Counter("prefixcache:prefix_cache_misses", "Requests whose cached match stopped short, by cause",
                              labelnames=["model_name", "cause"], registry=self.registry)
        self.requests = Counter("prefixcache:requests", "Completion requests answered, by API and HTTP status",
                                labelnames=["model_name", "api", "status"], registry=self.registry)

    def finish(self, out: RequestOutput, token_times: list[float]) -> None:
        """A finished sample: the first of a request counts the request; the others add inter-token latencies."""
        m = self.model_name
        for a, b in zip(token_times, token_times[1:]):
            self.itl.labels(m).observe(b - a)
        if out.index:
            return
        self.success.labels(m, out.finish_reason).inc()
        if out.miss_cause != "hit":
            self.misses.labels(m, out.miss_cause).inc()
        if out.ttft is not None:
            self.ttft.labels(m).observe(out.ttft)
        if out.latency is not None:
            self.e2e.labels(m).observe(out.latency)

    def status(self, api: str, status: int) -> None:
        self.requests.labels(self.model_name, api, str(status)).inc()

    def render(self, stats: dict) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
