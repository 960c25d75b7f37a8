"""Log analysis (hit rates actual vs achievable, causes) and the template fingerprint."""
import json

import pytest

from prefixcache.cli import main
from prefixcache.lint.check import Options
from prefixcache.lint.fingerprint import fingerprint
from prefixcache.lint.log import simulate
from prefixcache.lint.render import load_tokenizer
from prefixcache.lint.requests import parse
from prefixcache.lint.run import lint

SYSTEM = ("You are the support assistant for Acme Cloud Storage, version 2.3.1. Answer questions about plans, billing "
          "and the sync client. The Basic plan costs $9.99 per month and includes 128 GB. Keep answers short.")
TOOLS = [{"name": "get_invoice", "input_schema": {"type": "object"}}, {"name": "list_plans", "input_schema": {}}]


@pytest.fixture(scope="session", autouse=True)
def tok():
    return load_tokenizer()


def req(system: str = SYSTEM, user: str = "Hi", tools=TOOLS):
    body = {"tools": tools, "system": system, "messages": [{"role": "user", "content": user}]}
    return parse(body, "<mem>", json.dumps(body), 0, 0)


def test_simulate_block_granularity():
    a = list(range(40))
    b = list(range(20)) + [999] * 20
    assert simulate([a, a, b, list(range(16))], 16) == [
        0,  # cold
        32,  # 2 full blocks; the 40th token is recomputed anyway
        16,  # shares block 0 only
        0,  # a one-block prompt: its last token is recomputed, so its only block is not reused
    ]


def test_fingerprint_ignores_slots_and_tracks_static_text():
    base = fingerprint(req())
    assert fingerprint(req(user="Something else entirely")) == base
    assert fingerprint(req(tools=TOOLS[::-1])) == base  # canonical tool order
    assert fingerprint(req(system=SYSTEM + " Current date: 2025-03-04.")) == \
        fingerprint(req(system=SYSTEM + " Current date: 2026-11-29."))
    assert fingerprint(req(system=SYSTEM.replace("$9.99", "$12.99"))) != base  # a template deploy
    assert fingerprint(req(), chat_template="other") != base  # a model with another chat template


def write_log(path, systems: list[str]):
    path.write_text("".join(json.dumps({"request": {"system": s, "messages": [{"role": "user", "content": f"q{i}"}]}})
                            + "\n" for i, s in enumerate(systems)))


def test_log_hit_rates_and_causes(tmp_path):
    log = tmp_path / "log.jsonl"
    write_log(log, [f"Current date: 2025-03-0{i % 9 + 1}T10:00:00Z.\n{SYSTEM}" for i in range(6)])
    report = lint([], Options(min_tokens=16), [str(log)])
    [g] = report.groups
    assert g["requests"] == 6 and len(g["fingerprints"]) == 1
    assert g["actual_hit_rate"] < 0.2 < g["achievable_hit_rate"]
    assert g["causes"][0]["cause"].startswith("PC101") and g["causes"][0]["tokens_lost"] > 0
    assert g["prompt_tokens"] > 6 * 40


def test_log_template_change_is_a_new_version(tmp_path):
    log = tmp_path / "log.jsonl"
    write_log(log, [SYSTEM] * 3 + [SYSTEM.replace("$9.99", "$12.99")] * 3)
    [g] = lint([], Options(min_tokens=16), [str(log)]).groups
    assert len(g["fingerprints"]) == 2
    assert [c["cause"].split()[0] for c in g["causes"]] == ["PC105"]  # the one deploy-time miss


def test_clean_log_has_equal_rates_and_no_errors(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    write_log(log, [SYSTEM] * 4)
    with pytest.raises(SystemExit) as e:
        main(["lint", "--min-tokens", "16", "--requests", str(log)])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "4 requests" in out and "0 error(s)" in out
    [g] = lint([], Options(min_tokens=16), [str(log)]).groups
    assert g["actual_hit_rate"] == g["achievable_hit_rate"] > 0.5 and g["causes"] == []
