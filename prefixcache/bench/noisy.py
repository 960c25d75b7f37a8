"""Noisy neighbour: tenant b's time to first token while tenant a floods the server with unique long prompts from
several clients, against b unloaded. b's requests are its hot prefix plus a few new tokens.

The server and the flood each run in a process of their own, as in use (in one process, the clients' Python
threads would slow the server's through the GIL), and quiet and flooded phases alternate, so that the machine's
drift hits both alike. Each flooded phase starts once the flood has evicted `turnover` blocks. Writes
bench/results/noisy.{json,md}. Run: `python -m prefixcache.bench.noisy` (the default model; about 5 minutes).
The short and long forms of tests/server/test_noisy_neighbour.py run it on a tiny model.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

from prefixcache.bench.server import ADMIN_KEY, LocalServer, ServerOptions, scrape
from prefixcache.models.catalog import model_path
from prefixcache.models.cpu import cpu_info


@dataclass
class Setup:
    model: str
    shared_chunk: int
    threads: int
    kv_cache_bytes: int
    rounds: int = 4
    n: int = 15  # b's requests per phase
    hot: int = 1024  # tokens of b's prefix
    new: int = 16  # b's new tokens a request
    flooders: int = 4
    flood_tokens: int = 1500
    turnover: int = 1000  # blocks the flood evicts before a flooded phase is measured


@dataclass
class Result:
    setup: Setup
    quiet: list[float] = field(default_factory=list)  # b's seconds to its first token, unloaded
    loaded: list[float] = field(default_factory=list)  # the same under the flood
    cached: list[int] = field(default_factory=list)  # b's cached tokens, every request
    flood_requests: int = 0  # served to a while b was measured
    evicted: int = 0  # blocks the flood evicted while b was measured

    @property
    def ratio(self) -> float:
        return p90(self.loaded) / p90(self.quiet)


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def measure(s: Setup) -> Result:
    opts = ServerOptions(kv_cache_bytes=s.kv_cache_bytes, min_cache_tokens=0, extra=(
        "--model", s.model, "--shared-chunk", str(s.shared_chunk), "--num-threads", str(s.threads)))
    result = Result(s)
    rng = random.Random(5)
    hot = [rng.randrange(1000, 40000) for _ in range(s.hot)]
    with LocalServer(opts, ["a", "b"]) as srv, httpx.Client(
            base_url=srv.url, timeout=600, headers={"Authorization": f"Bearer {srv.keys['b']}"}) as client:
        def request() -> tuple[float, int]:
            return _completion(client, hot + [rng.randrange(1000, 40000) for _ in range(s.new)])

        def evictions() -> int:
            r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
            return int(scrape(r.text)["evictions"])

        request()  # b caches its prefix
        for k in range(s.rounds):
            for _ in range(s.n):
                t, cached = request()
                result.quiet.append(t)
                result.cached.append(cached)
            flood = subprocess.Popen([sys.executable, "-m", "prefixcache.bench.noisy", "--flood", srv.url,
                                      srv.keys["a"], str(s.flooders), str(s.flood_tokens), str(k)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                start = evictions()
                while evictions() < start + s.turnover:
                    assert flood.poll() is None, "the flood stopped"
                    time.sleep(0.1)
                before = evictions()
                for _ in range(s.n):
                    t, cached = request()
                    result.loaded.append(t)
                    result.cached.append(cached)
                result.evicted += evictions() - before
                out, _ = flood.communicate("")
            finally:
                flood.kill()
            assert flood.returncode == 0, "a flood request failed"
            result.flood_requests += int(out)
    return result


def _completion(client: httpx.Client, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached tokens) of a one-token completion."""
    t = time.perf_counter()
    r = client.post("/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def flood(url: str, key: str, clients: int, tokens: int, seed: int) -> int:
    """Clients sending unique `tokens`-token prompts one after another until standard input closes; the number of
    requests served."""
    stop, served = threading.Event(), []

    def run(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {key}"}) as c:
            while not stop.is_set():
                _completion(c, [rng.randrange(1000, 40000) for _ in range(tokens)])
                served.append(1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    sys.stdin.read()
    stop.set()
    for t in threads:
        t.join()
    return len(served)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flood", nargs=5, metavar=("URL", "KEY", "CLIENTS", "TOKENS", "SEED"),
                    help="(internal) be the flood process")
    ap.add_argument("--model", default="")
    ap.add_argument("--kv-cache-bytes", type=int, default=400 << 20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--turnover", type=int, default=200, help="blocks the flood evicts before a flooded phase")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.flood:
        url, key, clients, tokens, seed = args.flood
        print(flood(url, key, int(clients), int(tokens), int(seed)))
        return
    model = model_path(args.model)
    runs = []
    for chunk, threads in ((0, 1), (32, 1), (32, 2)):
        r = measure(Setup(model, chunk, threads, args.kv_cache_bytes, args.rounds, args.n, turnover=args.turnover))
        runs.append({**asdict(r), "ratio": r.ratio, "quiet_p90_s": p90(r.quiet), "loaded_p90_s": p90(r.loaded)})
        print(f"--shared-chunk {chunk}, {threads} engine thread(s): TTFT p90 {p90(r.loaded):.3f} s flooded, "
              f"{p90(r.quiet):.3f} s quiet: {r.ratio:.2f}x", flush=True)
    cpu = cpu_info()
    with open(f"{args.out}/noisy.json", "w") as f:
        json.dump({"cpu": str(cpu), "runs": runs}, f, indent=1)
    s = runs[0]["setup"]
    lines = ["# Noisy neighbour", "", f"{cpu.model} ({' '.join(cpu.simd)}), {cpu.threads} threads; model "
             f"{os.path.basename(model)}. "
             f"{s['flooders']} clients of tenant a flood unique {s['flood_tokens']}-token prompts; tenant b sends "
             f"its {s['hot']}-token prefix plus {s['new']} new tokens, {s['n']} requests a phase, {s['rounds']} "
             "quiet and flooded phases alternating. `python -m prefixcache.bench.noisy`.", "",
             "| --shared-chunk | engine threads | b's TTFT p90 quiet (s) | flooded (s) | ratio | a's requests served |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['setup']['shared_chunk']} | {r['setup']['threads']} | {r['quiet_p90_s']:.3f} | "
              f"{r['loaded_p90_s']:.3f} | {r['ratio']:.2f}x | {r['flood_requests']} |" for r in runs]
    with open(f"{args.out}/noisy.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
