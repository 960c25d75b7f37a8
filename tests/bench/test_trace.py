"""Mooncake-style traces (bench/trace.py): replayed as token prompts where equal hash ids are equal blocks, with
malformed lines reported by number and skipped or refused; and any workload exported as one, whose hash ids come
from our scope-chained block keys (two tenants' identical text never shares an id)."""
import asyncio
import json

import pytest
from server_fixtures import _start

from prefixcache.bench.driver import Load, Target, run
from prefixcache.bench.trace import BLOCK, export_trace, load_trace
from prefixcache.bench.workloads import Session, Turn, Workload
from prefixcache.config import Config
from prefixcache.server.config import ServeConfig

KEYS = {"default": "sk-default", "acme": "sk-acme", "globex": "sk-globex"}


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("trace") / "keys.json"
    keys.write_text(json.dumps({k: {"tenant": t} for t, k in KEYS.items()}))
    return _start("trace", ServeConfig(Config(model=tiny_model, min_cache_tokens=0), api_keys=str(keys)))


def write(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_equal_hash_ids_are_equal_blocks_and_arrivals_follow_the_timestamps(tmp_path):
    trace = write(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 700, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 2000, "input_length": 40, "output_length": 1, "hash_ids": [9]}])
    workload, problems = load_trace(trace, speed=2.0)
    assert problems == []
    [a], [b], [c] = (s.turns for s in workload.sessions)
    assert [len(a.prompt_ids), len(b.prompt_ids), len(c.prompt_ids)] == [700, 1100, 40]
    assert a.prompt_ids == b.prompt_ids[:700] and b.prompt_ids[2 * BLOCK:2 * BLOCK + 40] == c.prompt_ids
    assert a.prompt_ids[:BLOCK] != a.prompt_ids[BLOCK:]  # another id, other tokens
    assert [a.arrival, b.arrival, c.arrival] == [0.0, 1.0, 0.5] and [a.max_tokens, b.max_tokens] == [3, 5]


BAD = [("{not json", "not JSON"), ('["a list"]', "not a JSON object"),
       ({"timestamp": 0, "input_length": 10, "output_length": 1}, "no hash_ids"),
       ({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}, "timestamp must be"),
       ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "input_length must be"),
       ({"timestamp": 0, "input_length": 10, "output_length": 2.5, "hash_ids": [1]}, "output_length must be"),
       ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["x"]}, "hash_ids must be"),
       ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}, "1 ids for input_length 600")]


@pytest.mark.parametrize("row, message", BAD)
def test_a_malformed_line_is_refused_with_its_number(tmp_path, row, message):
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    trace = write(tmp_path / "t.jsonl", [good, row])
    with pytest.raises(ValueError, match=f"line 2: .*{message}"):
        load_trace(trace)


def test_malformed_lines_can_be_skipped_and_reported(tmp_path):
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    trace = write(tmp_path / "t.jsonl", [good, *(row for row, _ in BAD), good])
    workload, problems = load_trace(trace, errors="skip")
    assert workload.num_requests == 2 and [p.line for p in problems] == list(range(2, 2 + len(BAD)))
    assert all(m in str(p) for p, (_, m) in zip(problems, BAD))
    with pytest.raises(ValueError, match="speed"):
        load_trace(trace, speed=0)


def test_a_replayed_trace_hits_where_its_hash_ids_repeat(srv, tmp_path):
    trace = write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [11, 12]},
        {"timestamp": 400, "input_length": 1030, "output_length": 4, "hash_ids": [11, 12, 13]},
        {"timestamp": 800, "input_length": 600, "output_length": 4, "hash_ids": [14, 12]}])
    workload, _ = load_trace(trace)
    results, _ = asyncio.run(run(workload, Target("t", srv.url, KEYS), Load()))
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.prompt_tokens for r in results] == [600, 1030, 600]
    assert [r.output_tokens for r in results] == [4, 4, 4]  # ignore_eos: exactly output_length
    first, second, third = (r.cached_tokens for r in results)
    assert second >= 592 and third == 0  # the second repeats the first's 600 tokens; the third starts elsewhere


def test_an_exported_trace_keeps_tenants_apart_and_replays(srv, tmp_path):
    system = {"role": "system", "content": "You are the support desk of a bank. " * 60}

    def ask(tenant, q):
        return Session([Turn([system, {"role": "user", "content": q}], 3, arrival=0.5)], tenant=tenant)

    workload = Workload("w", [ask("acme", "Open an account?"), ask("acme", "Close one?"),
                              ask("globex", "Open an account?")])
    path = str(tmp_path / "exported.jsonl")
    assert export_trace(workload, Target("t", srv.url, KEYS), Load(), path) == 3
    rows = [json.loads(line) for line in open(path)]
    assert [r["timestamp"] for r in rows] == [500, 500, 500] and [r["output_length"] for r in rows] == [3, 3, 3]
    a1, a2, g = (r["hash_ids"] for r in rows)
    assert a1[0] == a2[0]  # one tenant's shared system prompt: one id
    assert not set(g) & set(a1 + a2)  # another tenant's identical text: none of acme's ids
    assert rows[0]["input_length"] == rows[2]["input_length"] > BLOCK
    replayed, problems = load_trace(path)
    assert problems == [] and replayed.num_requests == 3
