"""`prefixcache diff` / explain(): the first diverging token mapped back to message, field and character offset."""
import json
from os.path import commonprefix

import pytest

from prefixcache.cli import main
from prefixcache.lint.diff import explain
from prefixcache.lint.render import load_tokenizer, render
from prefixcache.lint.requests import parse

SYSTEM = ("You are the support assistant for Acme Cloud Storage, version 2.3.1. Answer questions about plans, billing "
          "and the sync client. The Basic plan costs $9.99 per month and includes 128 GB of storage.\n"
          "Keep answers short and friendly.")
TOOLS = [{"name": "get_invoice", "description": "Fetch an invoice.", "input_schema": {"type": "object"}},
         {"name": "list_plans", "description": "List plans.", "input_schema": {"type": "object"}}]


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()


def rendered(tok, body: dict):
    return render(parse(body, "<mem>", json.dumps(body), 0, 0), tok)


def chat(system: str, user: str) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def independent_common(tok, a: dict, b: dict) -> tuple[int, int]:
    """(common tokens, length of b) straight from the chat template, without the lint package."""
    ids = [tok(tok.apply_chat_template(m["messages"], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for m in (a, b)]
    return len(commonprefix(ids)), len(ids[1])


@pytest.mark.parametrize("edit", [
    lambda s: s.replace("$9.99", "$12.99"),  # system text
    lambda s: s.replace("short and friendly", "short  and friendly"),  # whitespace
    lambda s: s.replace(".\nKeep", ".\n\nKeep"),  # newline drift
])
def test_system_text_and_whitespace(tok, edit):
    a, b = chat(SYSTEM, "Hi"), chat(edit(SYSTEM), "Hi")
    d = explain(rendered(tok, a), rendered(tok, b))
    assert (d.location.message_index, d.location.field, d.location.role) == (0, "messages[0].content", "system")
    assert d.location.char_offset == len(commonprefix([SYSTEM, edit(SYSTEM)]))
    common, n = independent_common(tok, a, b)
    assert d.common_tokens == common
    assert d.reusable_blocks == min(common, n - 1) // 16 and d.reusable_tokens == d.reusable_blocks * 16


def test_last_user_turn(tok):
    a, b = chat(SYSTEM, "How much is the Pro plan?"), chat(SYSTEM, "How much is the Basic plan?")
    ra, rb = rendered(tok, a), rendered(tok, b)
    d = explain(ra, rb)
    assert (d.location.message_index, d.location.field, d.location.role) == (1, "messages[1].content", "user")
    assert d.location.char_offset == len("How much is the ")
    common, n = independent_common(tok, a, b)
    assert d.common_tokens == common and d.reusable_tokens == min(common, n - 1) // 16 * 16
    assert rb.text[d.char:].startswith("Basic") and ra.text[d.a_char:].startswith("Pro")


def test_tool_order(tok):
    a = {"tools": TOOLS, "system": SYSTEM, "messages": [{"role": "user", "content": "Hi"}]}
    b = {**a, "tools": TOOLS[::-1]}
    d = explain(rendered(tok, a), rendered(tok, b))
    assert (d.location.message_index, d.location.field) == (None, "tools[0]")
    assert d.location.char_offset == len(commonprefix([json.dumps(t, sort_keys=True) for t in TOOLS]))
    assert d.reusable_tokens < 16  # tools come first: nearly nothing is reusable


def test_anthropic_system_block_and_token_ids(tok):
    def body(date: str) -> dict:
        return {"system": [{"type": "text", "text": SYSTEM}, {"type": "text", "text": f"Date: {date}"}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    ra, rb = rendered(tok, body("2025-03-04")), rendered(tok, body("2025-03-05"))
    d = explain(ra, rb)
    assert (d.location.field, d.location.message_index, d.location.char_offset) == ("system[1].text", None, 15)
    server_view = explain(ra.token_ids, rb)  # what the server has: the cached entry's token ids only
    assert server_view.common_tokens == d.common_tokens and server_view.location.field == "system[1].text"
    assert server_view.char == rb.offsets[d.token_index][0] <= d.char


def test_identical_requests(tok):
    r = rendered(tok, chat(SYSTEM, "Hi"))
    d = explain(r, r)
    assert d.location is None and d.common_tokens == len(r.token_ids)
    assert d.reusable_tokens == (len(r.token_ids) - 1) // 16 * 16  # the last prompt token is always recomputed


def test_cli_diff(tok, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(chat(SYSTEM, "Hi")))
    b.write_text(json.dumps(chat(SYSTEM.replace("$9.99", "$12.99"), "Hi")))
    main(["diff", str(a), str(b)])
    out = capsys.readouterr().out
    assert "message 0 (system) messages[0].content char" in out and "blocks" in out
    main(["diff", "--format", "json", str(a), str(b)])
    d = json.loads(capsys.readouterr().out)
    assert d["location"]["char_offset"] == SYSTEM.index("$9.99") + 1
