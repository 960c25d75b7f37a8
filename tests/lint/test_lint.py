"""Linter corpus: each bad sample flagged with the right code at the right place, each good one clean."""
import json
import re
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.lint.check import Options
from prefixcache.lint.render import load_tokenizer
from prefixcache.lint.rules import RULES, volatile
from prefixcache.lint.run import lint

CORPUS = Path(__file__).parent.parent / "lint_corpus"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
OPTIONS = Options(**EXPECTED["options"])


@pytest.fixture(scope="session", autouse=True)
def tokenizer():
    return load_tokenizer()


def where(path: Path, loc: str) -> tuple[int, int]:
    """An explicit "line:col", or the 1-based position of the first occurrence of a snippet in the file (of the
    character after », if the snippet has one)."""
    if re.fullmatch(r"\d+:\d+", loc):
        return tuple(map(int, loc.split(":")))
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    i = text.index(loc.replace("»", "")) + max(loc.find("»"), 0)
    return text.count("\n", 0, i) + 1, i - (text.rfind("\n", 0, i) + 1) + 1


@pytest.mark.parametrize("name", sorted(EXPECTED["files"]))
def test_corpus(name):
    report = lint([str(CORPUS / name)], OPTIONS)
    got = sorted((f.code, f.line, f.col) for f in report.findings)
    want = sorted((code, *where(CORPUS / name, loc)) for code, loc in EXPECTED["files"][name])
    assert got == want, "\n".join(map(str, report.findings))


def test_corpus_covers_every_rule():
    codes = {code for findings in EXPECTED["files"].values() for code, _ in findings}
    assert codes == set(RULES)
    assert all(EXPECTED["files"][n] == [] for n in EXPECTED["files"] if n.startswith("good/"))


@pytest.mark.parametrize("text", [
    "Version 2.3.1 released in 2019; see section 4.2 and RFC 7231.",
    "The Pro plan costs $19.99 per month and includes 128 GB, up to 1,000,000 files.",
    "Office hours are 9:00-17:00, Monday to Friday. Call 1-800-555-0100.",
    "Pick a random item from the list. The user is a developer. Session management is covered in chapter 12.",
    "Write to support@acme.example or help@acme.example for help.",
    "Founded in March 2019 with 40 offices; 3 of 5 reviewers agreed.",
])
def test_stable_text_with_numbers_is_clean(text):
    assert volatile(text) == []


@pytest.mark.parametrize("text,code,value", [
    ("Current date: 2025-03-04.", "PC101", "2025-03-04"),
    ("Today is Monday, March 3, 2025.", "PC101", "Monday, March 3, 2025"),
    ("logged at 2025-03-04T10:15:00Z", "PC101", "2025-03-04T10:15:00Z"),
    ("ts 1732871234 done", "PC101", "1732871234"),
    ("trace 3f1c9e2a-7b4d-4e8f-9a6b-2c5d8e1f0a3b", "PC102", "3f1c9e2a-7b4d-4e8f-9a6b-2c5d8e1f0a3b"),
    ("request_id=abc123x", "PC102", "abc123x"),
    ("User: Alice Smith", "PC103", "Alice Smith"),
    ("email jane.doe@gmail.com", "PC103", "jane.doe@gmail.com"),
    ("seed: 48213", "PC104", "48213"),
])
def test_volatile_values_detected(text, code, value):
    hits = volatile(text)
    assert [(h.code, h.value, text[h.start:h.end]) for h in hits] == [(code, value, value)]


def test_cli_exit_code_and_json(capsys):
    with pytest.raises(SystemExit) as e:
        main(["lint", "--min-tokens", "64", "--format", "json", str(CORPUS / "bad/timestamp_system.json")])
    assert e.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert out["errors"] == 1 and out["findings"][0]["code"] == "PC101" and out["findings"][0]["cost_tokens"] > 0
    with pytest.raises(SystemExit) as e:
        main(["lint", "--min-tokens", "64", str(CORPUS / "good/openai_chat.json")])
    assert e.value.code == 0
    assert "0 error(s)" in capsys.readouterr().out


def test_min_tokens_is_an_option():
    path = str(CORPUS / "good/openai_chat.json")
    assert [f.code for f in lint([path], Options(min_tokens=100_000)).findings] == ["PC701"]
    assert lint([path], Options(min_tokens=64)).findings == []
