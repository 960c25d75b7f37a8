"""The capacity planner (prefixcache plan, bench/plan.py): a request log replayed through the real engine with a
stand-in model, per KV budget. (Its predictions against a live server of the real model are in the README; this
checks the replay itself: budgets, scopes, TTLs on the log's clock, the knee, the JSON, and its errors.)"""
import json
import subprocess
import sys

import pytest

from prefixcache.bench import plan

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model: 2 layers, 2 KV heads of 16, blocks of 16 tokens, fp32


def log(tmp_path, rows) -> str:
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def chat(tenant: str, system: str, question: str, arrival: float | None = None) -> dict:
    return {"tenant": tenant, "max_tokens": 2, **({"arrival": arrival} if arrival is not None else {}),
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


SYSTEM = {t: f"You are the assistant of {t}. " + " ".join(f"{t} rule {i}." for i in range(60)) for t in "ab"}


def test_more_memory_holds_more_of_each_tenants_prefix(tmp_path, tiny_model):
    rows = [chat(t, SYSTEM[t], f"question {i}?") for i in range(3) for t in "ab"]
    points = plan.plan(plan.load(log(tmp_path, rows)), [40 * BLOCK_BYTES, 400 * BLOCK_BYTES], model=tiny_model)
    small, large = points
    assert small.prompt_tokens == large.prompt_tokens > 0 and (small.blocks, large.blocks) == (39, 399)  # block 0: zeros
    assert large.hit_rate > small.hit_rate and small.evicted_blocks > large.evicted_blocks == 0
    # with room for both: each tenant's later requests hit its whole system prompt, never the other's
    prompt = large.prompt_tokens / 6
    assert large.cached_tokens >= 4 * (prompt - 24) and large.hit_rate < 4 / 6
    assert plan.knee(points) is large
    assert set(json.loads(plan.as_json(large))) >= {"budget_bytes", "hit_rate", "evicted_blocks"}


def test_entries_expire_on_the_logs_clock(tmp_path, tiny_model):
    rows = [chat("a", SYSTEM["a"], "first?", 0.0), chat("a", SYSTEM["a"], "again?", 600.0)]
    path, budget = log(tmp_path, rows), [400 * BLOCK_BYTES]
    [kept] = plan.plan(plan.load(path), budget, model=tiny_model)
    # 10 minutes apart, 5 to live
    [expired] = plan.plan(plan.load(path), budget, policy="ttl", ttl=300, model=tiny_model)
    [alive] = plan.plan(plan.load(path), budget, policy="ttl", ttl=3600, model=tiny_model)
    assert kept.cached_tokens > 0 and alive.cached_tokens == kept.cached_tokens and expired.cached_tokens == 0


def test_requests_a_live_server_refuses_are_counted_as_refused(tmp_path, tiny_model):
    """Larger than the whole budget, or than the context window (the tiny model's: 2,048 tokens)."""
    [p] = plan.plan(plan.load(log(tmp_path, [chat("a", SYSTEM["a"], "q?")])), [4 * BLOCK_BYTES], model=tiny_model)
    assert p.refused_requests == 1 and p.prompt_tokens == 0
    rows = [chat("a", SYSTEM["a"], "q?"), chat("a", "word " * 2500, "q?")]
    [p] = plan.plan(plan.load(log(tmp_path, rows)), [400 * BLOCK_BYTES], model=tiny_model)
    assert p.refused_requests == 1 and 0 < p.prompt_tokens < 2048


@pytest.mark.parametrize("kw, message", [
    ({"budgets": [BLOCK_BYTES]}, "less than two KV blocks"),
    ({"policy": "mru"}, "--policy: one of lru, fair, ttl"),
    ({"policy": "ttl"}, "needs --ttl"),
])
def test_bad_plans_are_clear_errors(tmp_path, tiny_model, kw, message):
    args = {"budgets": [100 * BLOCK_BYTES], **kw}
    with pytest.raises(ValueError, match=message):
        plan.plan(plan.load(log(tmp_path, [chat("a", "x", "y")])), model=tiny_model, **args)


def test_the_command_prints_a_table_json_and_a_plot(tmp_path, tiny_model):
    path = log(tmp_path, [chat(t, SYSTEM[t], "q?") for t in "abab"])
    run = [sys.executable, "-m", "prefixcache.cli", "plan", "--log", path, "--model", tiny_model,
           "--budgets", f"{40 * BLOCK_BYTES},{400 * BLOCK_BYTES}"]
    table = subprocess.run([*run, "--plot", str(tmp_path / "plan.png")], capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr
    assert "(knee)" in table.stdout and (tmp_path / "plan.png").stat().st_size > 1000
    lines = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=300).stdout.splitlines()
    assert [json.loads(x)["budget_bytes"] for x in lines] == [40 * BLOCK_BYTES, 400 * BLOCK_BYTES]
    bad = subprocess.run([*run[:-2], "--budgets", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "budgets must be positive" in bad.stderr
