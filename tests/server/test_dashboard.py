"""The operator's page (GET /dashboard) in a real headless browser (Debian's chromium): with the admin key in the
URL's fragment it shows the server's figures, they equal /metrics and /v1/cache/usage, and they move with traffic;
without the key it shows nothing. The figures and tenants live only behind an admin key."""
import re
import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import pytest
from server_fixtures import metrics, tiny_tenants_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Figures(HTMLParser):
    """id -> the text inside each element with an id (tables: their cells, one string per row)."""

    def __init__(self):
        super().__init__()
        self.stack: list[str | None] = []
        self.text: dict[str, str] = {}
        self.rows: dict[str, list[list[str]]] = {}

    def handle_starttag(self, tag, attrs):
        id_ = dict(attrs).get("id")
        self.stack.append(id_)
        if tag == "tr" and self.table():
            self.rows[self.table()].append([])
        if tag == "table" and id_:
            self.rows[id_] = []

    def handle_endtag(self, tag):
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        for id_ in filter(None, self.stack):
            self.text[id_] = self.text.get(id_, "") + data
        if self.table() and self.rows[self.table()] and data.strip():
            self.rows[self.table()][-1].append(data.strip())

    def table(self) -> str | None:
        return next((i for i in reversed(self.stack) if i in self.rows), None)


def page(url: str, key: str | None) -> Figures:
    """The page's DOM after its scripts ran for a few (virtual) seconds: three refreshes."""
    target = f"{url}/dashboard" + (f"#key={key}" if key else "")
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", target], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    f = Figures()
    f.feed(out.stdout)
    return f


def number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    return tiny_tenants_server(tmp_path_factory, tiny_model, "dashboard")


def ask(srv, key: str, prompt: str) -> None:
    r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "default", "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.skipif(CHROMIUM is None, reason="make setup installs chromium (Debian package)")
def test_the_page_shows_the_servers_figures_and_they_move(srv):
    shared = " ".join(f"word{i}" for i in range(80))
    for key in ("sk-a", "sk-b", "sk-a"):
        ask(srv, key, f"{shared} from {key}")
    first = page(srv.url, "sk-admin")
    m = metrics(srv.url)
    assert first.text.get("status", "") == "", first.text
    assert number(first.text["queried-tokens"]) == m[("vllm:prefix_cache_queries_total", ())]
    assert number(first.text["saved-tokens"]) == m[("vllm:prefix_cache_hits_total", ())] > 0
    assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", first.text["ttft-p50"])
    assert {row[0] for row in first.rows["tenants"][1:]} == {"a", "b"}
    assert first.rows["prefixes"][1][0] == "a" and int(first.rows["prefixes"][1][3]) >= 1  # a's prefix, reused

    for _ in range(3):
        ask(srv, "sk-b", f"{shared} from sk-b")
    second = page(srv.url, "sk-admin")
    m = metrics(srv.url)
    assert number(second.text["saved-tokens"]) == m[("vllm:prefix_cache_hits_total", ())] > \
        number(first.text["saved-tokens"])
    assert number(second.text["queried-tokens"]) > number(first.text["queried-tokens"])


@pytest.mark.skipif(CHROMIUM is None, reason="make setup installs chromium (Debian package)")
def test_without_an_admin_key_the_page_shows_nothing(srv):
    for key in (None, "sk-a"):
        f = page(srv.url, key)
        assert f.text["status"].startswith("needs an admin key") and f.text["saved-tokens"] == "-"
        assert not f.rows["tenants"]


def test_usage_is_for_admins_only(srv):
    for key in ("", "sk-a"):
        r = httpx.get(f"{srv.url}/v1/cache/usage", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code in (401, 403)
    usage = httpx.get(f"{srv.url}/v1/cache/usage", headers={"Authorization": "Bearer sk-admin"}).json()
    assert set(usage) == {"tenants", "prefixes"}
