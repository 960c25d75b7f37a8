"""Whole response bodies serialized a piece at a time, the event loop running between pieces: a body of many logprob
entries (up to caps.MAX_LOGPROB_ENTRIES, some 30 MB) takes a good part of a second to serialize, which every other
stream would otherwise wait for. The JSON is what starlette's JSONResponse writes."""
import asyncio
import json

CHUNK = 2048  # items of a list serialized at once


async def json_body(value) -> bytes:
    out: list[str] = []
    await _encode(value, out)
    return "".join(out).encode()


async def _encode(value, out: list[str]) -> None:
    if isinstance(value, dict):
        out.append("{")
        for i, (k, v) in enumerate(value.items()):
            out.append(("," if i else "") + _dumps(k) + ":")
            await _encode(v, out)
        out.append("}")
    elif isinstance(value, list) and len(value) > CHUNK:
        out.append("[")
        for i in range(0, len(value), CHUNK):
            out.append(("," if i else "") + _dumps(value[i:i + CHUNK])[1:-1])
            await asyncio.sleep(0)
        out.append("]")
    else:
        out.append(_dumps(value))


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
