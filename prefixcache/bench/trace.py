"""Mooncake-style traces, as the Mooncake and AIPerf tools write them: JSONL, one request per line,
{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [ids of the prompt's 512-token
blocks]}.

Replay (`prefixcache bench --trace FILE`): a hash id stands for 512 token ids drawn from a generator seeded by the
id, so equal ids give equal blocks (and equal prefixes), and a prompt is its blocks' tokens cut to input_length. It
goes to /v1/completions as token ids with ignore_eos, so every target prefills exactly input_length tokens and
writes exactly output_length, arriving at its timestamp divided by `speed`.

Export (`prefixcache bench --export-trace FILE`): any workload (built-in or a JSONL request log) as such a trace,
its prompts rendered and keyed by a server of ours (POST /v1/chat/completions/render and /v1/cache/keys, with each
tenant's own key). A block's hash id numbers our scope-chained block key at the block's last full 16 tokens, so
equal ids mean equal prefixes in one scope and two tenants' identical text never shares an id (a last partial
block is keyed by its full 16-token blocks; one with none gets an id of its own).
"""
import json
import math
import random
from dataclasses import dataclass

import httpx

from prefixcache.bench.driver import Load, Target, arrivals
from prefixcache.bench.workloads import Session, Turn, Workload

BLOCK = 512  # tokens per hash id
TOKENS = (1000, 30000)  # synthetic token ids: clear of the special tokens of Llama-family vocabularies


@dataclass
class Problem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def load_trace(path: str, speed: float = 1.0, errors: str = "refuse") -> tuple[Workload, list[Problem]]:
    """The trace as a workload of token prompts. A malformed line is a Problem: with errors "refuse" the first one
    is a ValueError naming its line; with "skip" the line is left out and reported."""
    if errors not in ("refuse", "skip"):
        raise ValueError(f"trace errors: 'refuse' or 'skip', got {errors!r}")
    if not speed > 0:
        raise ValueError(f"trace speed must be a positive number, got {speed}")
    rows, problems = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(_row(json.loads(line)))
            except ValueError as e:  # json.JSONDecodeError is one
                problem = Problem(n, f"not JSON: {e}" if isinstance(e, json.JSONDecodeError) else str(e))
                if errors == "refuse":
                    raise ValueError(f"{path}: {problem}") from None
                problems.append(problem)
    if not rows:
        raise ValueError(f"{path}: no requests in the trace")
    start = min(r[0] for r in rows)
    blocks: dict[int, list[int]] = {}
    sessions = [Session([Turn([], out, (ts - start) / 1000 / speed, _prompt(ids, length, blocks))])
                for ts, length, out, ids in rows]
    return Workload(path, sessions, f"trace {path}, {len(sessions)} requests, timestamps / {speed:g}"), problems


def export_trace(workload: Workload, target: Target, load: Load, path: str) -> int:
    """Write `workload` as a trace (timestamps: its arrivals, or Poisson at load.rate); returns the requests."""
    ids: dict[str, int] = {}
    with httpx.Client(timeout=120) as client, open(path, "w") as out:
        for session, arrival in zip(workload.sessions, arrivals(workload, load)):
            for turn, messages in session.logged():
                body = {"model": "default", "messages": messages, **({"tools": session.tools} if session.tools else {})}
                key = target.keys.get(session.tenant)
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                rendered = client.post(f"{target.url}/v1/chat/completions/render", json=body, headers=headers)
                keys = client.post(f"{target.url}/v1/cache/keys", headers=headers,
                                   json={"path": "/v1/chat/completions", "body": body})
                for r in (rendered, keys):
                    if r.status_code != 200:
                        raise ValueError(f"export: {r.request.url.path} answered {r.status_code}: {r.text[:200]}")
                length, block_size = len(rendered.json()["token_ids"]), keys.json()["block_size"]
                hashes = _hash_ids(keys.json()["keys"], length, block_size, ids)
                out.write(json.dumps({"timestamp": round((turn.arrival or arrival) * 1000), "input_length": length,
                                      "output_length": turn.max_tokens, "hash_ids": hashes}) + "\n")
    return workload.num_requests


def _row(raw) -> tuple[float, int, int, list[int]]:
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in raw:
            raise ValueError(f"no {key}")
    ts, length, out, ids = raw["timestamp"], raw["input_length"], raw["output_length"], raw["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise ValueError(f"timestamp must be milliseconds, 0 or more, got {ts!r}")
    for key, v in (("input_length", length), ("output_length", out)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a whole number of tokens, 1 or more, got {v!r}")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError("hash_ids must be a list of block ids (whole numbers, 0 or more)")
    if len(ids) != math.ceil(length / BLOCK):
        raise ValueError(f"hash_ids: {len(ids)} ids for input_length {length} (one per {BLOCK} tokens: "
                         f"{math.ceil(length / BLOCK)})")
    return float(ts), length, out, ids


def _prompt(ids: list[int], length: int, blocks: dict[int, list[int]]) -> list[int]:
    tokens = []
    for i in ids:
        if i not in blocks:
            rng = random.Random(i)
            blocks[i] = [rng.randrange(*TOKENS) for _ in range(BLOCK)]
        tokens += blocks[i]
    return tokens[:length]


def _hash_ids(keys: list[str], length: int, block_size: int, ids: dict[str, int]) -> list[int]:
    """One id per BLOCK tokens: the number of the scope-chained key of the block's last full block_size tokens."""
    per = BLOCK // block_size
    out = []
    for j in range(math.ceil(length / BLOCK)):
        last = min((j + 1) * per, len(keys)) - 1
        key = keys[last] if last >= j * per else f"partial:{len(ids)}"  # no full block in it: an id of its own
        out.append(ids.setdefault(key, len(ids)))
    return out
