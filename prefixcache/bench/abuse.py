"""Abuse (issue 33): tenant b's greedy stream while tenant a attacks the server, against b unloaded. b streams a
short chat answer one request after another and records its time to the first token and the gaps between tokens.

As in noisy.py, the server and the attacker each run in a process of their own, and quiet and flooded phases
alternate so that the machine's drift hits both alike; every attack gets a server of its own, so its memory
high-water mark (VmHWM) is that attack's. Writes bench/results/abuse.{json,md}. Run:
`python -m prefixcache.bench.abuse` (the default model; about 13 minutes here).
"""
import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from statistics import median

import httpx

from prefixcache.bench.noisy import p90
from prefixcache.bench.server import ADMIN_KEY, LocalServer, ServerOptions
from prefixcache.models.catalog import model_path
from prefixcache.models.cpu import cpu_info
from prefixcache.server.caps import MAX_STRING

PROMPT = {"model": "default", "prompt": "hi", "max_tokens": 4}
MESSAGES = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
ASK = {"model": "default", "messages": [{"role": "user", "content": "Count from one to thirty in words."}],
       "max_tokens": 32, "temperature": 0, "stream": True}
BIG = "tenant " * (MAX_STRING // 7)  # a string prompt at the cap on any one string
HOG = [("POST", "/v1/completions", {**PROMPT, "max_tokens": 256, "ignore_eos": True, "stream": True})]
UNREAD = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000, "n": 4,
          "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}  # the largest chunks, never read
KEYS_IDS = {"path": "/v1/completions", "body": {**PROMPT, "prompt": [1000 + i % 39000 for i in range(140_000)]}}
LONG = {**PROMPT, "prompt": "tenant " * 3000, "n": 4}  # prompt logprobs recompute the prompt: a prefill each time
FRESH = {**PROMPT, "prompt": "@N@ " + "tenant " * 700, "max_tokens": 256, "ignore_eos": True, "stream": True}  # @N@:
# a number of its own each time, so every prompt is new
DOC = " ".join(f"Section {i}: the handbook's rule number {i} applies to every order." for i in range(90))
CACHED_ASK = {**ASK, "messages": [{"role": "system", "content": DOC}, *ASK["messages"]],
              "stream_options": {"include_usage": True}}  # b's answers read a prefix of about 1,300 tokens it cached
ATTACKS = {  # name -> (a's concurrent clients, the requests each sends in turn)
    "n bomb": (4, [("POST", "/v1/completions", {**PROMPT, "n": 100_000_000})]),
    "bad_words bomb": (4, [("POST", "/v1/completions", {**PROMPT, "bad_words": ["word"] * 100_000}),
                           ("POST", "/v1/completions/render", {**PROMPT, "bad_words": ["word"] * 100_000})]),
    "stop_sequences bomb": (4, [("POST", "/v1/messages", {**MESSAGES, "stop_sequences": ["s"] * 100_000})]),
    "capacity hog, at capacity": (80, HOG),  # max_num_seqs + max_queue, the server's defaults
    "capacity hog, over it": (96, HOG),
    "prompts at the string cap": (4, [("POST", "/v1/completions", {**PROMPT, "prompt": BIG})]),
    "cache keys bomb, token ids": (4, [("POST", "/v1/cache/keys", KEYS_IDS)]),  # 0.9 MB: under the 1 MiB body cap
    "cache keys bomb, a prompt at the string cap": (4, [("POST", "/v1/cache/keys", {"path": "/v1/completions",
                                                                      "body": {**PROMPT, "prompt": BIG}})]),
    # issue 57: what a request leaves behind or holds
    "unread streams": (4, [("UNREAD", "/v1/chat/completions", UNREAD)]),
    "big bodies": (3, [("POST", "/v1/completions", {**LONG, "prompt_logprobs": 20})]),  # 250,000 logprob entries
    "long prompts, small bodies": (3, [("POST", "/v1/completions", {**LONG, "prompt_logprobs": 0})]),  # the control
    "purge flood": (4, [("DELETE", "/v1/cache", None)]),
    # b's cached prefix under a's load: on a pool a's streams overflow, and with an L2 a's unique prompts churn
    "running load against b's cache": (8, [("POST", "/v1/completions", FRESH)]),
    "L2 flood": (8, [("POST", "/v1/completions", {**FRESH, "max_tokens": 4, "stream": False})]),
}
CACHE = {  # attack -> the server's flags: a pool that holds b's prefix and a little more (46 KB a token), an L2
    "running load against b's cache": ("--kv-cache-bytes", str(160 << 20)),
    "L2 flood": ("--kv-cache-bytes", str(160 << 20), "--disk-cache", "@L2@", "--disk-cache-gb", "0.5"),
}


@dataclass
class Phase:
    ttft: list[float] = field(default_factory=list)  # b's seconds to its first token, a request each
    gaps: list[float] = field(default_factory=list)  # b's seconds between tokens, every request's
    refused: list[int] = field(default_factory=list)  # b's statuses other than 200
    cached: list[int] = field(default_factory=list)  # b's prompt tokens read from the cache, a request each


@dataclass
class Result:
    attack: str
    quiet: Phase = field(default_factory=Phase)
    flooded: Phase = field(default_factory=Phase)
    a: dict[int, int] = field(default_factory=dict)  # a's statuses: how many of each
    hwm_quiet_mb: float = 0.0  # the server's VmHWM before the first attack
    hwm_mb: float = 0.0  # and at the end
    attack_s: float = 0.0  # seconds the attacker ran
    attacker_cpu_s: float = 0.0  # CPU seconds its process took of the machine's cores, which the server shares

    def ratios(self) -> dict[str, float]:
        q, f = self.quiet, self.flooded
        return {"ttft_p90": p90(f.ttft) / p90(q.ttft), "itl_p50": median(f.gaps) / median(q.gaps),
                "max_gap": max(f.gaps) / max(q.gaps)}


def measure(model: str, attack: str, rounds: int, n: int, warmup: float) -> Result:
    result = Result(attack)
    ask = CACHED_ASK if attack in CACHE else ASK
    with tempfile.TemporaryDirectory() as l2:
        opts = ServerOptions(extra=("--model", model, *(f.replace("@L2@", l2) for f in CACHE.get(attack, ()))))
        with LocalServer(opts, ["a", "b"]) as srv, httpx.Client(
                base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {srv.keys['b']}"}) as client:
            _rounds(srv, client, result, ask, rounds, n, warmup)
    return result


def _rounds(srv: LocalServer, client: httpx.Client, result: Result, ask: dict, rounds: int, n: int,
            warmup: float) -> None:
    attack = result.attack
    stream(client, Phase(), ask)  # the first request pays for warm-up (and caches b's prefix)
    for k in range(rounds):
        for _ in range(n):
            stream(client, result.quiet, ask)
        if k == 0:
            result.hwm_quiet_mb = srv.rss_mb()["peak_rss_mb"]
        attacker = subprocess.Popen([sys.executable, "-m", "prefixcache.bench.abuse", "--attack", srv.url,
                                     srv.keys["a"], attack], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True)
        try:
            assert attacker.stdout.readline() == "ready\n", "the attacker did not start"
            start = time.perf_counter()
            time.sleep(warmup)
            assert attacker.poll() is None, "the attacker stopped"
            for _ in range(n):
                stream(client, result.flooded, ask)
            out, _ = attacker.communicate("")
        finally:
            attacker.kill()
        result.attack_s += time.perf_counter() - start
        got = json.loads(out)
        result.attacker_cpu_s += got["cpu_s"]
        for s, c in got["statuses"].items():
            result.a[int(s)] = result.a.get(int(s), 0) + c
        idle(srv.url)  # a's cut streams are cancelled before the next quiet phase
    result.hwm_mb = srv.rss_mb()["peak_rss_mb"]


def stream(client: httpx.Client, phase: Phase, ask: dict) -> None:
    """One greedy streamed chat answer of b's, its timings (and the cached tokens it read, if asked) added to
    `phase`."""
    t = time.perf_counter()
    times = []
    with client.stream("POST", "/v1/chat/completions", json=ask) as r:
        if r.status_code != 200:
            phase.refused.append(r.status_code)
            return
        for line in r.iter_lines():
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {"choices": []}
            if any(c["delta"].get("content") for c in chunk["choices"]):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                phase.cached.append(chunk["usage"]["prompt_tokens_details"]["cached_tokens"])
    phase.ttft.append(times[0] - t)
    phase.gaps += [b - a for a, b in zip(times, times[1:])]


def idle(url: str) -> None:
    while True:
        r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
        if not any(line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
                   and float(line.split()[-1]) for line in r.text.splitlines()):
            return
        time.sleep(0.2)


def attack(url: str, key: str, name: str) -> dict:
    """a's clients sending the attack's requests until standard input closes; the statuses they got and this
    process's CPU seconds from their start. The clients' threads are daemons: what is in flight when the input closes
    is cut off as the process exits."""
    clients, bodies = ATTACKS[name]
    # encoded once: the client's CPU is b's too
    requests = [(method, path, None if body is None else json.dumps(body).encode()) for method, path, body in bodies]
    statuses: dict[int, int] = {}
    numbers = itertools.count()

    def run() -> None:
        with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {key}",
                                                              "Content-Type": "application/json"}) as c:
            while True:
                for method, path, body in requests:
                    if method == "UNREAD":
                        unread(url, key, path, body)
                        continue
                    fresh = body and body.replace(b"@N@", str(next(numbers)).encode())
                    with c.stream(method, path, content=fresh) as r:
                        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                        for _ in r.iter_raw():
                            pass

    t0 = os.times()
    for _ in range(clients):
        threading.Thread(target=run, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()
    t = os.times()
    return {"statuses": statuses, "cpu_s": t.user + t.system - t0.user - t0.system}


def unread(url: str, key: str, path: str, body: bytes) -> None:
    """A streamed request whose client reads its status line and nothing more, for longer than the server's
    --stream-stall-timeout (30 s), with a small receive window so that the server's writes block soon."""
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        s.recv(12)
        time.sleep(40)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attack", nargs=3, metavar=("URL", "KEY", "NAME"), help="(internal) be the attacker process")
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", type=int, default=5, help="b's requests a phase")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of attack before b is measured")
    ap.add_argument("--only", nargs="*", choices=list(ATTACKS), default=list(ATTACKS))
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.attack:
        print(json.dumps(attack(*args.attack)), flush=True)
        return
    model = model_path(args.model)
    runs = []
    for name in args.only:
        r = measure(model, name, args.rounds, args.n, args.warmup)
        runs.append({**asdict(r), "ratios": r.ratios()})
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.ratios().items()) +
              f"; a got {r.a}, b refused {r.flooded.refused}", flush=True)
    cpu = cpu_info()
    flags = f"--rounds {args.rounds} --n {args.n} --warmup {args.warmup}"
    with open(f"{args.out}/abuse.json", "w") as f:
        json.dump({"cpu": str(cpu), "model": os.path.basename(model), "flags": flags, "runs": runs}, f, indent=1)
    lines = ["# Abuse", "", f"{cpu.model} ({' '.join(cpu.simd)}), {cpu.threads} threads; model "
             f"{os.path.basename(model)}; {flags}. Tenant b streams a greedy chat answer of {ASK['max_tokens']} "
             f"tokens, one request after another, {args.n} a phase, {args.rounds} quiet and flooded phases "
             "alternating; tenant a attacks from its own process, each attack on a server of its own. The cache rows "
             "give b a system prompt of about 1,300 tokens it caches first, on a KV pool of 160 MiB (and an L2 of "
             "0.5 GiB): a's streams of fresh 700-token prompts overflow it. Target: every ratio at most 1.5x, b's "
             "cached tokens kept. `python -m prefixcache.bench.abuse`.", "",
             "| attack | a's clients | b's TTFT p90 quiet / flooded (s) | ratio | inter-token p50 quiet / flooded (ms) "
             "| ratio | longest gap quiet / flooded (ms) | ratio | server VmHWM quiet / end (MB) | a's statuses "
             "| b's refusals | b's cached tokens quiet / flooded (median) | attacker's CPU (cores) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        q, f, x = r["quiet"], r["flooded"], r["ratios"]
        a = ", ".join(f"{c}× {s}" for s, c in sorted(r["a"].items()))
        cached = f"{median(q['cached']):.0f} / {median(f['cached']):.0f}" if r["attack"] in CACHE else "-"
        lines.append(f"| {r['attack']} | {ATTACKS[r['attack']][0]} | {p90(q['ttft']):.3f} / {p90(f['ttft']):.3f} | "
                     f"{x['ttft_p90']:.2f}x | {1e3 * median(q['gaps']):.1f} / {1e3 * median(f['gaps']):.1f} | "
                     f"{x['itl_p50']:.2f}x | {1e3 * max(q['gaps']):.0f} / {1e3 * max(f['gaps']):.0f} | "
                     f"{x['max_gap']:.2f}x | {r['hwm_quiet_mb']:.0f} / {r['hwm_mb']:.0f} | {a} | "
                     f"{len(f['refused'])} | {cached} | {r['attacker_cpu_s'] / r['attack_s']:.2f} |")
    with open(f"{args.out}/abuse.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
