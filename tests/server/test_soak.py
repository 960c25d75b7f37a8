"""A long run against a live server: 2,000 requests, each with a salt (so a cache scope) of its own. Nothing the
server keeps per request or per scope may grow with the number of requests."""
from concurrent.futures import ThreadPoolExecutor

import httpx
from server_fixtures import metrics, tiny_server

from prefixcache.engine.engine import TTFT_WINDOW

REQUESTS, WARMUP, CLIENTS = 2000, 300, 4
RSS_GROWTH_MB = 40  # after warm-up; the removed-keys memory alone may take a few MB by the end


def _rss_mb() -> float:
    with open("/proc/self/status") as f:  # the server runs in this process
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _send(url: str, ids: range) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in ids:
            r = c.post("/v1/chat/completions", json={
                "model": "default", "max_tokens": 2, "temperature": 0, "cache_salt": f"soak-{i}",
                "messages": [{"role": "user", "content": f"Request {i % 7}: say something short."}]})
            assert r.status_code == 200, r.text


def _drive(url: str, start: int, stop: int) -> None:
    with ThreadPoolExecutor(CLIENTS) as pool:
        for f in [pool.submit(_send, url, range(start + k, stop, CLIENTS)) for k in range(CLIENTS)]:
            f.result()


def test_two_thousand_unique_scopes_leave_bounded_state(tiny_model):
    srv = tiny_server(tiny_model)
    engine = srv.server.engine
    _drive(srv.url, 0, WARMUP)
    rss, series = _rss_mb(), len(metrics(srv.url))
    _drive(srv.url, WARMUP, REQUESTS)
    cache = engine.blocks.cache
    assert engine.blocks.stats()["query_tokens"] > 0 and sum(cache.evictions.values()) > 0  # the budget was hit
    assert cache.num_scopes <= cache.num_blocks <= engine.pool.usable_blocks  # scopes live only with their blocks
    assert len(engine.ttfts) == TTFT_WINDOW
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not srv.server.worker.live and srv.server.worker.in_flight == 0
    assert len(metrics(srv.url)) == series  # no metric series per request or per scope
    assert _rss_mb() - rss < RSS_GROWTH_MB
