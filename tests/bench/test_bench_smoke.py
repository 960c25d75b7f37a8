"""`prefixcache bench --quick` against real servers (the default model) finishes, writes every file, and its
figures agree with the server's own counters and with what the workload itself allows."""
import json
import random
import subprocess
import sys

from prefixcache.bench.workloads import Size, build, system_prompt
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import tokenizer as load_tokenizer
from prefixcache.prompt import encode_system, fields, render

BLOCK = 16


def _floor(n: int) -> int:
    return n // BLOCK * BLOCK


def _shared_prompt_floor(tokenizer) -> tuple[int, int]:
    """(prompt tokens, the cached tokens the shared-system-prompt workload guarantees): every request but the
    first that computes it reuses at least the full blocks that all requests have in common."""
    workload = build("shared-system-prompt", 0, Size.quick())
    prompts = [render(tokenizer, fields({"messages": t.messages, "tools": s.tools})).token_ids
               for s in workload.sessions for t in s.turns]
    common = min(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a in prompts for b in prompts if a is not b)
    return sum(map(len, prompts)), (len(prompts) - 1) * _floor(common)


def test_quick_bench_writes_reports_and_plots(tmp_path):
    cmd = [sys.executable, "-m", "prefixcache.cli", "bench", "--quick", "--out", str(tmp_path), "--users", "4"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    folder = tmp_path / "quick"
    for name in ("report.json", "report.md", "on_off.png", "prefix_length.png", "arrival_rate.png",
                 "memory_budget.png"):
        assert (folder / name).stat().st_size > 0, name
    assert "| TTFT p50 (s) |" in (folder / "report.md").read_text()
    report = json.loads((folder / "report.json").read_text())
    for workload in ("shared-system-prompt", "multi-tenant"):
        on, off = report["runs"][workload]["cache on"], report["runs"][workload]["cache off"]
        assert on["errors"] == 0 and off["errors"] == 0
        assert on["prompt_tokens"] == off["prompt_tokens"]
        # the clients' summed cached_tokens are exactly the hits the server counted during the run
        assert on["cached_tokens"] == on["server_hit_tokens"] > 0
        assert off["cached_tokens"] == off["server_hit_tokens"] == 0

    tokenizer = load_tokenizer(default_model_path())
    prompt_tokens, floor = _shared_prompt_floor(tokenizer)
    on = report["runs"]["shared-system-prompt"]["cache on"]
    assert on["prompt_tokens"] == prompt_tokens
    assert on["cached_tokens"] >= floor > 0

    lengths = [p["target_tokens"] for p in report["sweeps"]["prefix_length"]]
    assert lengths == [128, 384]
    for i, p in enumerate(report["sweeps"]["prefix_length"]):  # the hit reuses at least the system prompt's blocks
        system = encode_system(tokenizer, system_prompt(random.Random(1000 + i), p["target_tokens"]))
        assert _floor(len(system)) <= p["cached_tokens"] < p["prompt_tokens"]
