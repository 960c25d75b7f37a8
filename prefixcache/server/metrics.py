"""Prometheus metrics: vLLM's series under vLLM's names, meanings, units, buckets and labels (`model_name`,
`engine`), so that vLLM's dashboards, its benchmark's hit-rate snapshot and gateways' endpoint pickers read a replica
as they read vLLM; our own names (prefixcache:*) only where vLLM has no series: misses by cause, evictions by reason,
the KV tiers, KV events, and requests by API and HTTP status. One CollectorRegistry per app.

Per-request histograms and counters are observed when a request ends. Engine state (cache queries and hits, KV
usage, evictions, queue depth) is read from an engine.stats() snapshot taken on the engine thread at scrape time,
and exported by a collector, so the counters are the engine's own.
"""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixcache.engine.sequence import RequestOutput
from prefixcache.slo import Objectives

ENGINE = "0"  # vLLM's engine label: one engine core per replica here
LABELS = ["model_name", "engine"]
# vLLM 0.32's buckets (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, ... up to the context window."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class EngineCollector:
    def __init__(self, model_name: str, block_size: int):
        self.labels, self.block_size = [model_name, ENGINE], block_size
        self.stats: dict = {}

    def collect(self):
        s, labels = self.stats, self.labels
        if not s:
            return

        def family(kind, name: str, doc: str, value: float):
            m = kind(name, doc, labels=LABELS)
            m.add_metric(labels, value)
            return m

        yield family(CounterMetricFamily, "vllm:prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache", s["query_tokens"])
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits",
                     "Prompt tokens found in the prefix cache", s["hit_tokens"])
        steps = CounterMetricFamily("prefixcache:step_tokens", "Tokens computed in engine steps, by kind: prompt "
                                    "tokens (prefill) or a sequence's next token and its drafts (decode)",
                                    labels=["model_name", "kind"])
        for kind, n in s["step_tokens"].items():
            steps.add_metric(labels[:1] + [kind], n)
        yield steps
        yield family(CounterMetricFamily, "vllm:num_preemptions",
                     "Running requests preempted for memory (recomputed later)", s["preemptions"])
        for name, doc in (("drafts", "Speculative drafts verified"),
                          ("draft_tokens", "Draft tokens verified"),
                          ("accepted_tokens", "Draft tokens accepted")):
            yield family(CounterMetricFamily, f"vllm:spec_decode_num_{name}", doc, s[f"spec_{name}"])
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                     "Fraction of KV blocks in use, live or cached (1: all)", s["occupancy_perc"] / 100)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting for admission",
                     s["waiting"])
        yield family(GaugeMetricFamily, "vllm:num_requests_running",
                     "Requests being prefilled or decoded", s["running"])
        ev = CounterMetricFamily("prefixcache:cache_evictions", "Cache blocks removed, by reason",
                                 labels=["model_name", "reason"])
        for reason, n in s["evictions"].items():
            ev.add_metric(labels[:1] + [reason], n)
        yield ev
        tiers = s.get("tiers")
        if tiers:
            c = tiers["counts"]  # the KV tiers below host memory, vLLM's external prefix cache
            yield family(CounterMetricFamily, "vllm:external_prefix_cache_queries", "Prompt tokens looked up in the "
                         "KV tiers below memory (L2 disk, L3 Redis)",
                         c.get("lookup_blocks", 0) * self.block_size)
            yield family(CounterMetricFamily, "vllm:external_prefix_cache_hits", "Prompt tokens found in the KV "
                         "tiers below memory",
                         c.get("lookup_found", 0) * self.block_size)
        yield from _tiers(tiers, labels[:1])


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
    def __init__(self, model_name: str, max_model_len: int, cache_info: dict[str, str],
                 objectives: Objectives = Objectives()):
        """cache_info: vllm:cache_config_info's labels (block_size, the KV dtype, whether prefix caching is on)."""
        self.labels = [model_name, ENGINE]
        self.objectives = objectives
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model_name, int(cache_info["block_size"]))
        self.registry.register(self.engine)
        kw = dict(labelnames=LABELS, registry=self.registry)
        info = Gauge("vllm:cache_config_info", "The KV cache's configuration, as labels (the value is 1)",
                     labelnames=[*cache_info, "engine"], registry=self.registry)
        info.labels(**cache_info, engine=ENGINE).set(1)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first output token", buckets=TTFT_BUCKETS, **kw)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Seconds from a request's arrival to its last output token", buckets=LATENCY_BUCKETS, **kw)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Seconds from a request's arrival to the first engine step it is in",
                               buckets=LATENCY_BUCKETS, **kw)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Seconds between a request's output tokens",
                             buckets=ITL_BUCKETS, **kw)
        tokens = token_buckets(max_model_len)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens of each request",
                                        buckets=tokens, **kw)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Output tokens of each sample",
                                            buckets=tokens, **kw)
        self.prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", **kw)
        self.prompt_cached = Counter("vllm:prompt_tokens_cached",
                                     "Prompt tokens served from a cache, in memory or below", **kw)
        self.generation = Counter("vllm:generation_tokens", "Output tokens generated", **kw)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason",
                               labelnames=[*LABELS, "finished_reason"], registry=self.registry)
        self.misses = Counter("prefixcache:prefix_cache_misses", "Requests whose cached match stopped short, by cause",
                              labelnames=["model_name", "cause"], registry=self.registry)
        self.requests = Counter("prefixcache:requests", "Completion requests answered, by API and HTTP status",
                                labelnames=["model_name", "api", "status"], registry=self.registry)
        self.slo = Counter("prefixcache:slo_requests", "Finished requests against each latency objective the server "
                           "was given (--slo-ttft-ms, --slo-tpot-ms; TPOT as vLLM's benchmark), met or missed",
                           labelnames=["model_name", "objective", "result"], registry=self.registry)
        for name in objectives.given():  # both series exist from the start, so attainment is never 0 / 0 unseen
            for result in ("met", "missed"):
                self.slo.labels(model_name, name, result)

    def finish(self, out: RequestOutput, token_times: list[float]) -> None:
        """A finished sample: the first of a request counts the request and its prompt; every one adds its output
        tokens and inter-token latencies."""
        m = self.labels
        for a, b in zip(token_times, token_times[1:]):
            self.itl.labels(*m).observe(b - a)
        self.generation.labels(*m).inc(len(out.token_ids))
        self.request_generation.labels(*m).observe(len(out.token_ids))
        if out.index:
            return
        self.success.labels(*m, out.finish_reason).inc()
        self.prompt.labels(*m).inc(len(out.prompt_token_ids))
        self.prompt_cached.labels(*m).inc(out.cached_tokens)
        self.request_prompt.labels(*m).observe(len(out.prompt_token_ids))
        if out.miss_cause != "hit":
            self.misses.labels(m[0], out.miss_cause).inc()
        if out.ttft is not None:
            self.ttft.labels(*m).observe(out.ttft)
        if out.queue_time is not None:
            self.queue.labels(*m).observe(out.queue_time)
        if out.latency is not None:
            self.e2e.labels(*m).observe(out.latency)
        if out.ttft is not None and out.latency is not None:
            for name, met in self.objectives.met(out.ttft, out.latency, len(out.token_ids)).items():
                self.slo.labels(m[0], name, "met" if met else "missed").inc()

    def abort(self) -> None:
        """A request that ended before its first output (a client gone, a stream cut)."""
        self.success.labels(*self.labels, "abort").inc()

    def status(self, api: str, status: int) -> None:
        self.requests.labels(self.labels[0], api, str(status)).inc()

    def render(self, stats: dict) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)
