"""Async HTTP load driver for any OpenAI-compatible server: closed loop (N users) or open loop (Poisson).

Every request streams (`stream_options.include_usage`), so we time the first content token (TTFT), the gaps
between content chunks (inter-token latency) and the end (e2e), and read `prompt_tokens_details.cached_tokens`
from the final usage chunk. A session's turns run one after another; with `carry`, the next request includes
the reply just received.
"""
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from prefixcache.bench.workloads import Session, Turn, Workload


@dataclass
class Target:
    name: str
    url: str  # base URL, e.g. http://127.0.0.1:8000
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> API key
    model: str = ""  # "" : the first id from /v1/models


@dataclass
class Result:
    session: int
    turn: int
    tenant: str
    start: float  # seconds since the run started
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the target did not report it
    output_tokens: int = 0
    text: str = ""


@dataclass
class Load:
    users: int = 8  # closed loop: concurrent users
    rate: float | None = None  # open loop: sessions per second (Poisson); overrides users
    seed: int = 0
    temperature: float = 0.0
    timeout: float = 600.0


async def model_id(client: httpx.AsyncClient, target: Target) -> str:
    if target.model:
        return target.model
    key = next(iter(target.keys.values()), None)
    r = await client.get(f"{target.url}/v1/models", headers=_headers(key))
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def send(client: httpx.AsyncClient, target: Target, model: str, session: Session, turn: Turn,
               messages: list[dict], load: Load, res: Result, t0: float) -> None:
    """One streamed request: chat messages, or a trace's token ids to /v1/completions (all max_tokens of them)."""
    if turn.prompt_ids is None:
        path, body = "/v1/chat/completions", {"messages": messages}
        if session.tools:
            body["tools"] = session.tools
    else:
        path, body = "/v1/completions", {"prompt": turn.prompt_ids, "ignore_eos": True}
    body.update(model=model, max_tokens=turn.max_tokens, temperature=load.temperature, stream=True,
                stream_options={"include_usage": True}, user=session.tenant)
    start = time.perf_counter()
    res.start = start - t0
    last, parts = None, []
    try:
        async with client.stream("POST", f"{target.url}{path}", json=body,
                                 headers=_headers(target.keys.get(session.tenant))) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                delta = choice.get("text") if turn.prompt_ids is not None else choice.get("delta", {}).get("content")
                if delta:
                    parts.append(delta)
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    u = chunk["usage"]
                    res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        res.e2e = time.perf_counter() - start
        if res.ttft is None:  # an empty reply: the first token is the end
            res.ttft = res.e2e
        res.text, res.ok = "".join(parts), True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"


async def run_session(client, target, model, idx: int, session: Session, load: Load, t0: float,
                      on_done) -> list[Result]:
    history, results = [], []
    for i, turn in enumerate(session.turns):
        messages = history + turn.messages if session.carry else turn.messages
        res = Result(idx, i, session.tenant, 0.0)
        await send(client, target, model, session, turn, messages, load, res, t0)
        results.append(res)
        on_done(res)
        if not res.ok:
            break
        history = messages + [{"role": "assistant", "content": res.text}]
    return results


async def run(workload: Workload, target: Target, load: Load, on_done=lambda r: None) -> tuple[list[Result], float]:
    """Drive the whole workload; returns the results and the wall time of the run."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=load.timeout, limits=limits) as client:
        model = await model_id(client, target)
        t0 = time.perf_counter()
        sessions = list(enumerate(workload.sessions))
        if load.rate is not None or any(t.arrival is not None for s in workload.sessions for t in s.turns):
            starts = arrivals(workload, load)

            async def delayed(i, s):
                await asyncio.sleep(max(0.0, starts[i] - (time.perf_counter() - t0)))
                return await run_session(client, target, model, i, s, load, t0, on_done)

            groups = await asyncio.gather(*(delayed(i, s) for i, s in sessions))
        else:
            queue = asyncio.Queue()
            for item in sessions:
                queue.put_nowait(item)

            async def user() -> list[Result]:
                out = []
                while not queue.empty():
                    i, s = queue.get_nowait()
                    out += await run_session(client, target, model, i, s, load, t0, on_done)
                return out

            groups = await asyncio.gather(*(user() for _ in range(load.users)))
        wall = time.perf_counter() - t0
    return sorted((r for g in groups for r in g), key=lambda r: (r.session, r.turn)), wall


def arrivals(workload: Workload, load: Load) -> list[float]:
    """Session start times: the JSONL `arrival` of the first turn when given, else Poisson at `load.rate`."""
    given = [s.turns[0].arrival for s in workload.sessions]
    if all(a is not None for a in given):
        return given
    rng, t, out = random.Random(load.seed), 0.0, []
    for _ in workload.sessions:
        out.append(t)
        t += rng.expovariate(load.rate or 1.0)
    return out
