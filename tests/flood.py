"""A tenant flooding a server, in a process of its own (so that its clients do not share a GIL with the clients
being measured): `python flood.py URL KEY CLIENTS TOKENS SEED`. Each client sends unique TOKENS-token prompts, one
after another, until standard input closes; then it prints the number of requests served."""
import random
import sys
import threading

import httpx


def flood(url: str, key: str, clients: int, tokens: int, seed: int) -> int:
    stop, served = threading.Event(), []

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": "default", "max_tokens": 1, "temperature": 0,
                                                    "prompt": [rng.randrange(1000, 40000) for _ in range(tokens)]})
                assert r.status_code == 200, r.text
                served.append(1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    sys.stdin.read()
    stop.set()
    for t in threads:
        t.join()
    return len(served)


if __name__ == "__main__":
    url, key, clients, tokens, seed = sys.argv[1:]
    print(flood(url, key, int(clients), int(tokens), int(seed)))
