"""Whole response bodies serialized a piece at a time, the event loop running between pieces: a body of many logprob
entries (up to caps.MAX_LOGPROB_ENTRIES, some 30 MB) takes a good part of a second to make and serialize, which every
other stream would otherwise wait for (and the engine thread, for the interpreter). The JSON is what starlette's
JSONResponse writes.

The long lists of a body are `Items`: made while they are serialized, and serialized once however many choices
hold them (completions repeat the prompt's logprobs in each).
"""
import asyncio
import json
import time
from typing import Any, Callable

PIECE = 64  # items of a list made and serialized at once
SLICE = 0.002  # seconds of serializing between two turns of the event loop


class Items:
    """A JSON list of `count` items, item i made by `make(i)` as it is serialized."""

    def __init__(self, count: int, make: Callable[[int], Any]):
        self.count, self.make = count, make
        self.text: str | None = None  # its JSON, once serialized

    def __iter__(self):
        return map(self.make, range(self.count))


def dumps(value) -> str:
    """The JSON of a small value (a stream's chunk), Items included, in one go."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"), default=list)


async def json_body(value) -> bytes:
    out: list[str] = []
    await _Encoder().encode(value, out)
    return "".join(out).encode()


class _Encoder:
    def __init__(self):
        self.since = time.perf_counter()  # when the event loop last ran

    async def encode(self, value, out: list[str]) -> None:
        if isinstance(value, dict):
            out.append("{")
            for i, (k, v) in enumerate(value.items()):
                out.append(("," if i else "") + dumps(k) + ":")
                await self.encode(v, out)
            out.append("}")
        elif isinstance(value, Items):
            if value.text is None:
                pieces: list[str] = []
                await self._pieces(value.make, value.count, pieces)
                value.text = "".join(pieces)
            out.append(value.text)
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):  # choices: each on its own
            out.append("[")
            for i, v in enumerate(value):
                out.append("," if i else "")
                await self.encode(v, out)
                await self._turn()
            out.append("]")
        elif isinstance(value, list) and len(value) > PIECE:
            await self._pieces(value.__getitem__, len(value), out)
        else:
            out.append(dumps(value))

    async def _pieces(self, make: Callable[[int], Any], count: int, out: list[str]) -> None:
        out.append("[")
        for i in range(0, count, PIECE):
            out.append(("," if i else "") + dumps([make(j) for j in range(i, min(i + PIECE, count))])[1:-1])
            await self._turn()
        out.append("]")

    async def _turn(self) -> None:
        """Let the event loop run, if it has waited SLICE."""
        if time.perf_counter() - self.since > SLICE:
            await asyncio.sleep(0)
            self.since = time.perf_counter()
