"""Anthropic-compatible endpoint: POST /v1/messages, with cache_control breakpoints, streaming or not.

Each block that carries `cache_control` (a tool, a system block, a message content block) becomes an engine
Breakpoint at the token position where that block ends in the rendered prompt; a top-level `cache_control`
marks the last content block of the last message. Content blocks of one message are joined with newlines;
tool_use and tool_result blocks are rendered as text. The `cache_salt` and `prompt_cache_key` extension
fields narrow the scope as in the OpenAI API.
"""
import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from prefixcache.engine.sequence import Breakpoint, SamplingParams
from prefixcache.server.auth import client_salt
from prefixcache.server.errors import ApiError, Extra, parse
from prefixcache.server.generation import Generation
from prefixcache.server.prompt import MARK, clean, render, system_text, tool_json

MAX_BREAKPOINTS = 4

router = APIRouter()


class CacheControl(Extra):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class Block(Extra):
    type: Literal["text", "tool_use", "tool_result"]
    text: str | None = None
    name: str | None = None  # tool_use
    input: Any = None  # tool_use
    content: str | list["Block"] | None = None  # tool_result
    cache_control: CacheControl | None = None

    def render(self) -> str:
        if self.type == "text":
            if self.text is None:
                raise ApiError(400, "text blocks need a `text` field")
            return clean(self.text)
        if self.type == "tool_use":
            return clean(json.dumps({"tool_use": self.name, "input": self.input}, ensure_ascii=False))
        content = self.content if isinstance(self.content, str) else "\n".join(b.render() for b in self.content or [])
        return clean(content)


class Message(Extra):
    role: Literal["user", "assistant"]
    content: str | list[Block] = Field(min_length=1)


class Tool(Extra):
    name: str
    input_schema: dict = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class MessagesRequest(Extra):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    cache_control: CacheControl | None = None
    cache_salt: str | None = None
    prompt_cache_key: str | None = None


def marked(text: str, cc: CacheControl | None, ttls: list[str]) -> str:
    """The block's text, ending with MARK if it carries a breakpoint (whose TTL is appended to ttls)."""
    if cc is None:
        return text
    ttls.append(cc.ttl)
    return text + MARK


def build_prompt(tokenizer, req: MessagesRequest) -> tuple[list[int], list[Breakpoint]]:
    """Render tools -> system -> messages; breakpoints in that order."""
    if req.cache_control is not None:  # automatic: the last block of the last message
        last = req.messages[-1]
        if isinstance(last.content, str):
            last.content = [Block(type="text", text=last.content)]
        if last.content[-1].cache_control is None:
            last.content[-1].cache_control = req.cache_control
    ttls: list[str] = []
    tools = [marked(tool_json(t.model_dump(exclude={"cache_control"}, exclude_none=True)), t.cache_control, ttls)
             for t in req.tools or []]
    if isinstance(req.system, list):
        system = "\n".join(marked(b.render(), b.cache_control, ttls) for b in req.system)
    else:
        system = clean(req.system) if req.system else None
    msgs = [{"role": "system", "content": s}] if (s := system_text(tools, system)) is not None else []
    for m in req.messages:
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        msgs.append({"role": m.role, "content": "\n".join(marked(b.render(), b.cache_control, ttls) for b in blocks)})
    if len(ttls) > MAX_BREAKPOINTS:
        raise ApiError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                            f"Found {len(ttls)}.")
    if "5m" in ttls and "1h" in ttls[ttls.index("5m"):]:
        raise ApiError(400, "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block")
    prompt = render(tokenizer, msgs)
    return prompt, [Breakpoint(p, t) for p, t in zip(prompt.marks, ttls) if p > 0]


def usage(gen: Generation) -> dict:
    w = gen.cache_write
    w5, w1 = w.get("5m", 0), w.get("1h", 0)
    read = gen.cached_tokens
    return {"input_tokens": gen.prompt_tokens - read - w5 - w1, "cache_creation_input_tokens": w5 + w1,
            "cache_read_input_tokens": read,
            "cache_creation": {"ephemeral_5m_input_tokens": w5, "ephemeral_1h_input_tokens": w1},
            "output_tokens": len(gen.output.token_ids) if gen.output else 1}


def stop_reason(tokenizer, gen: Generation, stops: list[str]) -> tuple[str, str | None]:
    out = gen.output
    if out.finish_reason == "length":
        return "max_tokens", None
    rest = tokenizer.decode(out.token_ids, skip_special_tokens=True)[len(out.text):]
    hit = next((s for s in stops if rest.startswith(s)), None)
    return ("stop_sequence", hit) if hit else ("end_turn", None)


@router.post("/v1/messages")
async def messages(request: Request):
    server = request.app.state.server
    principal = server.auth(request)
    req = await parse(request, MessagesRequest)
    server.check_model(req.model)
    if req.max_tokens >= server.engine.max_model_len:
        raise ApiError(400, f"max_tokens must be below the context window ({server.engine.max_model_len})")
    prompt, breakpoints = build_prompt(server.tokenizer, req)
    stops = [s for s in req.stop_sequences or [] if s]
    params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p or 1.0,
                            top_k=req.top_k or 0, max_tokens=req.max_tokens, stop=stops)
    gen = await server.generate(request, "anthropic", principal, prompt.token_ids, params,
                                client_salt(req.cache_salt, req.prompt_cache_key),
                                breakpoints, where=prompt.where)
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": server.model_name}

    if not req.stream:
        text = await gen.text()
        reason, seq = stop_reason(server.tokenizer, gen, stops)
        return JSONResponse({**message, "content": [{"type": "text", "text": text}], "stop_reason": reason,
                             "stop_sequence": seq, "usage": usage(gen)}, headers=gen.header())

    def sse(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    async def events():
        try:
            yield sse("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                                    "stop_sequence": None, "usage": usage(gen)}})
            yield sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            async for delta in gen.deltas():
                yield sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta}})
            yield sse("content_block_stop", {"index": 0})
            reason, seq = stop_reason(server.tokenizer, gen, stops)
            yield sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(gen)})
            yield sse("message_stop", {})
        finally:
            gen.close()

    return StreamingResponse(events(), media_type="text/event-stream", headers=gen.header())
