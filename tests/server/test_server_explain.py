"""The server explains every cache miss: where the match stopped (message, offset) and why."""
import httpx
import pytest
from server_fixtures import long_system, main_server, metrics, prefix_header


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    return main_server(tmp_path_factory)


def chat(srv, system: str, key: str = "sk-acme", question: str = "Which rule applies?") -> dict[str, str]:
    r = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": "default", "max_tokens": 2, "temperature": 0, "cache_salt": "explain",
                         "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return prefix_header(r.headers)


def test_miss_causes_with_their_location(srv):
    system = long_system("explain", 12)
    assert chat(srv, system)["miss"] == "cold"
    assert chat(srv, system)["miss"] == "hit"
    change = system.index("Rule 7")
    edited = system[:change] + "Law" + system[change + 4:]
    h = chat(srv, edited)
    assert h["miss"] == "diverged" and h["message"] == "0"
    assert change - 8 <= int(h["offset"]) <= change  # the first token that differs starts at (or just before) it
    assert chat(srv, system, key="sk-globex")["miss"] == "cold"  # acme's copy is invisible to globex
    assert chat(srv, system, key="sk-globex", question="Another question?")["miss"] == "diverged"
    assert chat(srv, "Be brief.")["miss"] == "below_min_length"
    before = metrics(srv.url).get(("prefixcache:prefix_cache_misses_total", (("cause", "evicted"),)), 0)
    r = httpx.delete(f"{srv.url}/v1/cache", headers={"Authorization": "Bearer sk-acme"})
    assert r.status_code == 200
    h = chat(srv, system)
    assert h["miss"] == "evicted" and h["cached"] == "0"
    after = metrics(srv.url)[("prefixcache:prefix_cache_misses_total", (("cause", "evicted"),))]
    assert after == before + 1
