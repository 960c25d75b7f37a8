"""A request's output that its client does not read (issue 57): the engine never waits on a client, so what it
leaves unread must stay bounded. Updates merge per sample while unread (their memory is the text, not a copy of
it per step), and a stream left unread for --stream-stall-timeout is aborted, its sequences leaving the engine."""
import asyncio
import json
import socket

import pytest
from server_fixtures import _start, metrics, until

from prefixcache.cache.scope import CacheScope
from prefixcache.config import Config
from prefixcache.engine.engine import Engine
from prefixcache.engine.sequence import SamplingParams
from prefixcache.server.config import ServeConfig
from prefixcache.server.mailbox import MERGE_AFTER
from prefixcache.server.worker import EngineWorker

N, MAX_TOKENS = 4, 1500


def test_unread_updates_hold_each_sample_text_once(tiny_model):
    """No handler reads: past MERGE_AFTER waiting updates, new ones merge into their sample's latest, whose texts
    and step times add up to the samples' whole outputs (before, each step queued a copy of the whole text: memory
    grew as tokens^2)."""
    worker = EngineWorker(lambda: Engine(Config(model=tiny_model, kv_cache_bytes=2**24)), stall_seconds=3600)

    async def run():
        worker.start(asyncio.get_running_loop())
        params = SamplingParams(max_tokens=200, ignore_eos=True, n=N, seed=5, logprobs=1)
        handle = worker.submit(list(range(100, 140)), params, CacheScope(), [])
        while sum(u.output is not None for u in handle.updates.waiting) < N:
            await asyncio.sleep(0.01)
        return handle.updates.waiting

    try:
        waiting = asyncio.run(run())
    finally:
        worker.stop()
    assert len(waiting) == MERGE_AFTER  # N * 200 updates came
    for i in range(N):
        mine = [u for u in waiting if u.index == i]
        assert "".join(u.text for u in mine) == mine[-1].output.text and len(mine[-1].output.token_ids) == 200
        assert sum(len(u.times) for u in mine) == 200 == sum(len(u.logprobs) for u in mine)


@pytest.fixture(scope="module")
def stalling(tiny_model):
    return _start("stalling", ServeConfig(Config(model=tiny_model, kv_cache_bytes=2**24, max_num_seqs=N),
                                          stream_stall_timeout=0.5))


def test_a_stream_its_client_does_not_read_is_aborted(stalling):
    worker = stalling.server.worker
    # the largest chunks a client may ask for (20 alternatives a token), so the server's socket buffers fill soon
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "max_tokens": MAX_TOKENS, "n": N, "ignore_eos": True, "seed": 1, "logprobs": True,
                       "top_logprobs": 20}).encode()
    port = int(stalling.url.rsplit(":", 1)[1])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small windows: the server's writes block soon
        s.connect(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        until(lambda: worker.live)
        until(lambda: not worker.live)  # its samples left the engine, while the client read nothing
        s.settimeout(30)
        raw = b""
        while chunk := s.recv(1 << 16):
            raw += chunk
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert "the client read nothing of this stream" in events[-1]["error"]["message"]
    assert not any(c["finish_reason"] for e in events[:-1] for c in e["choices"])  # aborted, not run to its end
    until(lambda: worker.in_flight == 0)



def test_a_whole_body_request_whose_client_left_is_aborted(stalling):
    """Not streamed: the client hangs up while its request runs; the request is aborted, not run to its end."""
    worker = stalling.server.worker
    before = metrics(stalling.url)
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}], "n": N,
                       "max_tokens": MAX_TOKENS, "ignore_eos": True}).encode()
    port = int(stalling.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        until(lambda: any(len(q.output_ids) > 50 for h in list(worker.live.values()) for q in h.seqs))  # past start
    until(lambda: worker.in_flight == 0)
    after = metrics(stalling.url)
    ended = {k[1]: after[k] - before.get(k, 0) for k in after if k[0] == "vllm:request_success_total"}
    assert ended.get((("finished_reason", "abort"),)) == 1 and not ended.get((("finished_reason", "length"),))
