"""Whole bodies serialized a piece at a time (server/body.py) are the JSON starlette writes, byte for byte."""
import asyncio
import json

from starlette.responses import JSONResponse

from prefixcache.server.body import CHUNK, json_body


def test_a_body_in_pieces_is_the_json_of_the_whole():
    entries = [{"token": f"tök{i}", "logprob": -i / 7, "bytes": [116, 195, 182]} for i in range(3 * CHUNK + 5)]
    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": "a\nb\"c", "logprobs": {"content": entries},
                                         "prompt_logprobs": [None, *entries[:CHUNK + 1]]}], "usage": {"n": [1, 2]},
            "empty": [], "big_empty_after": {}}
    assert asyncio.run(json_body(body)) == JSONResponse(body).body
    assert json.loads(asyncio.run(json_body(entries))) == entries
