"""Whole bodies serialized a piece at a time (server/body.py) are the JSON starlette writes, byte for byte; their long
lists are made as they are serialized, once however many choices hold them, and the event loop runs between pieces."""
import asyncio
import json

from starlette.responses import JSONResponse

from prefixcache.server import body as body_module
from prefixcache.server.body import PIECE, Items, json_body


def test_a_body_in_pieces_is_the_json_of_the_whole():
    entries = [{"token": f"tök{i}", "logprob": -i / 7, "bytes": [116, 195, 182]} for i in range(3 * PIECE + 5)]
    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": "a\nb\"c", "logprobs": {"content": entries},
                                         "prompt_logprobs": [None, *entries[:PIECE + 1]]}], "usage": {"n": [1, 2]},
            "empty": [], "big_empty_after": {}}
    assert asyncio.run(json_body(body)) == JSONResponse(body).body
    assert json.loads(asyncio.run(json_body(entries))) == entries


def test_items_are_made_once_as_they_are_serialized_however_many_choices_hold_them():
    entries = [None, *({"t": i, "top": [i, -i / 3]} for i in range(5 * PIECE))]
    made = []
    items = Items(len(entries), lambda i: made.append(i) or entries[i])
    small = Items(2, entries.__getitem__)
    body = {"choices": [{"index": k, "prompt_logprobs": items} for k in range(4)], "small": small}
    plain = {"choices": [{"index": k, "prompt_logprobs": entries} for k in range(4)], "small": entries[:2]}
    assert asyncio.run(json_body(body)) == JSONResponse(plain).body
    assert made == list(range(len(entries)))
    assert json.dumps({"x": Items(3, entries.__getitem__)}, default=list) == json.dumps({"x": entries[:3]})


def test_the_event_loop_runs_between_the_pieces_of_a_body(monkeypatch):
    monkeypatch.setattr(body_module, "SLICE", 0.0)  # a turn after every piece, however fast the machine
    turns = []

    async def main() -> bytes:
        async def tick():
            while True:
                turns.append(1)
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        before = len(turns)
        out = await json_body({"prompt_logprobs": Items(10 * PIECE, lambda i: {"i": i})})
        ticker.cancel()
        return out, len(turns) - before

    out, during = asyncio.run(main())
    assert json.loads(out)["prompt_logprobs"][-1] == {"i": 10 * PIECE - 1}
    assert during >= 10  # a turn for each piece
