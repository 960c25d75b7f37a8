"""The capacity planner (prefixcache plan, bench/plan.py): a request log replayed through the real engine with a
stand-in model, per KV budget. (Its predictions against a live server of the real model are in the README; this
checks the replay itself: budgets, scopes, TTLs on the log's clock, the knee, the JSON, and its errors.)"""
import json
import subprocess
import sys

import pytest
import torch

from prefixcache.bench import plan, plan_live, plan_tiers
from prefixcache.bench.redis_lru import RedisLedger

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
    # block 0: zeros
    assert small.prompt_tokens == large.prompt_tokens > 0 and (small.blocks, large.blocks) == (39, 399)
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


def test_blocks_evicted_from_memory_are_found_on_disk(tmp_path, tiny_model):
    """L2 keeps what L1 evicts for room (as many as fit), and a later request loads it past its L1 match."""
    rows = [chat(t, SYSTEM[t], f"question {i}?") for i in range(3) for t in "ab"]
    workload, small = plan.load(log(tmp_path, rows)), [40 * BLOCK_BYTES]
    [memory] = plan.plan(workload, small, model=tiny_model)
    [disk] = plan.plan(workload, small, model=tiny_model, tiers={"L2": 10**9})
    one = plan_tiers.block_sizes((2, 16, 2, 16), torch.float32, "")["L2"]
    [one_block] = plan.plan(workload, small, model=tiny_model, tiers={"L2": one})
    [large] = plan.plan(workload, [400 * BLOCK_BYTES], model=tiny_model)
    assert memory.tier_tokens == {} and disk.tier_tokens["L2"] > 0
    assert memory.hit_rate < disk.hit_rate <= large.hit_rate and disk.evicted_blocks == memory.evicted_blocks
    assert one_block.tier_tokens["L2"] < disk.tier_tokens["L2"] and one_block.hit_rate < disk.hit_rate


def test_redis_keeps_every_block_until_its_ttl_on_the_logs_clock(tmp_path, tiny_model):
    """L3 is written through, so a block evicted from L1 is there, until redis_ttl (an hour) has passed."""
    def replay(gap: float):
        rows = [chat("a", SYSTEM["a"], "first?", 0.0), chat("b", SYSTEM["b"], "evict a", gap / 2),
                chat("a", SYSTEM["a"], "again?", gap)]
        return plan.plan(plan.load(log(tmp_path, rows)), [30 * BLOCK_BYTES], model=tiny_model,
                         tiers={"L3": 10**9})[0]
    soon, late = replay(600.0), replay(7200.0)
    assert soon.tier_tokens["L3"] > 0 and soon.cached_tokens >= soon.tier_tokens["L3"]
    assert late.tier_tokens.get("L3", 0) == 0 and late.cached_tokens < soon.cached_tokens


@pytest.mark.parametrize("text, message", [
    ("tape:1GiB", "parts are disk:SIZE and redis:SIZE"), ("disk:8GiB,disk:1GiB", "disk given twice"),
    ("redis:0", "not a positive size"), ("disk", "parts are"),
])
def test_bad_tiers_are_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        plan_tiers.parse(text)


def test_a_tier_smaller_than_a_block_is_a_clear_error(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="L2's 100 bytes hold no block"):
        plan.plan(plan.load(log(tmp_path, [chat("a", "x", "y")])), [100 * BLOCK_BYTES], model=tiny_model,
                  tiers={"L2": 100})


def test_the_prediction_with_a_disk_tier_is_what_a_live_server_measures(tmp_path, tiny_model):
    """The tiny model served for real (a subprocess with --disk-cache), one user replaying the log."""
    rows = [chat(t, SYSTEM[t], f"question {i}?") for i in range(3) for t in "ab"] + [chat("a", SYSTEM["a"], "last?")]
    workload, budgets, tiers = plan.load(log(tmp_path, rows)), [30 * BLOCK_BYTES, 40 * BLOCK_BYTES], {"L2": 2**20}
    predicted = plan.plan(workload, budgets, model=tiny_model, tiers=tiers)
    measured = plan_live.measure_hit_rates(workload, budgets, tiers=tiers, model=tiny_model)
    [memory_only] = plan.plan(workload, budgets[:1], model=tiny_model)
    assert all(p.tier_tokens["L2"] > 0 for p in predicted) and memory_only.hit_rate < predicted[0].hit_rate
    assert [round(p.hit_rate, 3) for p in predicted] == [round(m, 3) for m in measured]


def test_the_redis_model_evicts_by_sampling_within_a_second_and_by_age_across_seconds():
    """Redis's volatile-lru: an idle time in whole seconds, 5 keys sampled per eviction, a pool of the 16 idlest."""
    now = [0.0]
    def fill(ledger, start: int, n: int):
        for i in range(start, start + n):
            ledger.room(100, "o")
            ledger.add("o", f"k{i}", 100, 3600, now[0])
    same_second = RedisLedger(100 * 100, lambda: now[0], seed=1)
    fill(same_second, 0, 200)  # 100 fit; all written in one second: which survive is a draw
    survivors = {int(k[1:]) for k in same_second.entries}
    assert len(survivors) == 100 and min(survivors) < 100 and same_second.evicted == 100
    again = RedisLedger(100 * 100, lambda: now[0], seed=1)
    fill(again, 0, 200)
    assert set(again.entries) == set(same_second.entries)  # one seeded draw: the same log, the same answer
    aged = RedisLedger(100 * 100, lambda: now[0], seed=1)
    fill(aged, 0, 100)
    now[0] = 60.0
    fill(aged, 100, 50)  # a minute later: the idle ones go first, nearly always
    assert sum(int(k[1:]) >= 100 for k in aged.entries) == 50


def test_the_redis_model_drops_expired_keys_before_it_evicts():
    now = [0.0]
    ledger = RedisLedger(10 * 100, lambda: now[0])
    for i in range(10):
        ledger.add("o", f"old{i}", 100, 5 if i < 4 else 3600, now[0])
    now[0] = 10.0
    assert [k for k, _ in ledger.room(400, "o")] == [] and len(ledger.entries) == 6 and ledger.bytes == 600
    assert ledger.get("o", "old0", now[0]) is None and ledger.get("o", "old9", now[0]) is not None


def test_a_full_redis_tier_gives_the_median_and_range_of_its_draws(tmp_path, tiny_model):
    rows = [chat(t, SYSTEM[t], f"question {i}?", 10.0 * (3 * i + j)) for i in range(3) for j, t in enumerate("ab")]
    workload = plan.load(log(tmp_path, rows))
    one = plan_tiers.block_sizes((2, 16, 2, 16), torch.float32, "")["L3"]
    [full] = plan.plan(workload, [30 * BLOCK_BYTES], model=tiny_model, tiers={"L3": 30 * one})
    [room] = plan.plan(workload, [30 * BLOCK_BYTES], model=tiny_model, tiers={"L3": 10**9})
    assert full.l3_evicted and full.hit_rate_range[0] <= full.hit_rate <= full.hit_rate_range[1]
    assert not room.l3_evicted and room.hit_rate_range is None and room.hit_rate >= full.hit_rate_range[1]
