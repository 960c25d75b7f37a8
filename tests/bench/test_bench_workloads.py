"""Workload generators are deterministic per seed; the JSONL loader reads OpenAI and Anthropic requests."""
import json
from dataclasses import asdict

import pytest

from prefixcache.bench.workloads import GENERATORS, Size, build, load_jsonl


@pytest.mark.parametrize("name", list(GENERATORS))
def test_same_seed_same_requests_other_seed_differs(name):
    size = Size.quick()
    a, b, c = (asdict(build(name, seed, size)) for seed in (7, 7, 8))
    assert a == b
    assert a != c
    assert a["sessions"] and all(s["turns"] for s in a["sessions"])


def test_shapes():
    size = Size(requests=8, prefix_tokens=600, turns=4, tenants=3)
    shared = build("shared-system-prompt", 0, size)
    firsts = {json.dumps(s.turns[0].messages[0]) for s in shared.sessions}
    assert len(firsts) == 1 and len({s.turns[0].messages[1]["content"] for s in shared.sessions}) == 8
    assert shared.sessions[0].tools

    chat = build("multi-turn", 0, size)
    assert len(chat.sessions) == 2 and all(s.carry and len(s.turns) == 4 for s in chat.sessions)

    volatile = build("volatile-prefix", 0, size)
    systems = [s.turns[0].messages[0]["content"] for s in volatile.sessions]
    assert len(set(systems)) == 8 and len({t.split("\n", 1)[1] for t in systems}) == 1

    tenants = build("multi-tenant", 0, size)
    assert tenants.tenants == ["tenant0", "tenant1", "tenant2"]
    by_tenant = {}
    for s in tenants.sessions:
        by_tenant.setdefault(s.tenant, set()).add(s.turns[0].messages[0]["content"])
    assert all(len(v) == 1 for v in by_tenant.values()) and len({next(iter(v)) for v in by_tenant.values()}) == 3

    rag = build("rag", 0, size)
    assert len({s.turns[0].messages[1]["content"][:200] for s in rag.sessions}) > 1

    code = build("code-edit", 0, size)  # speculative decoding's: the answer copies the prompt
    asks = [s.turns[0].messages[0]["content"] for s in code.sessions]
    assert all("```python\n" in a and a.count("\n") > 40 for a in asks) and len(set(asks)) > 1
    quote = build("rag-quote", 0, size)
    assert len({s.turns[0].messages[0]["content"] for s in quote.sessions}) == 2
    agent = build("agent-steps", 0, size)
    assert agent.tenants == ["agent"] and {s.tenant for s in agent.sessions} == {"agent"}
    assert len({json.dumps(s.turns[0].messages[:-1]) for s in agent.sessions}) == 1  # the same examples
    assert all(s.turns[0].max_tokens == 10 * size.max_tokens for s in code.sessions + quote.sessions)


def test_jsonl_openai_and_anthropic(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "tenant": "a", "arrival": 0.5},
             {"system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
              "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}], "tenant": "b"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = load_jsonl(str(path), default_max_tokens=9)
    one, two = w.sessions
    assert (one.tenant, one.turns[0].arrival, one.turns[0].max_tokens) == ("a", 0.5, 5)
    tool = '{"description": "d", "input_schema": {"type": "object"}, "name": "f"}'  # as the server renders it
    assert two.turns[0].messages == [{"role": "system", "content": f"# Tools\n{tool}\n\nBe brief."},
                                     {"role": "user", "content": "hello"}]
    assert two.tools is None and two.turns[0].max_tokens == 9
    assert w.tenants == ["a", "b"]
