"""Anthropic-compatible endpoint: POST /v1/messages, with cache_control breakpoints, streaming or not.

Each block that carries `cache_control` (a tool, a system block, a message content block) becomes an engine
Breakpoint at the token position where that block ends in the rendered prompt; a top-level `cache_control`
marks the last content block of the last message. The request is rendered by prefixcache/prompt.py. The
`cache_salt` and `prompt_cache_key` extension fields narrow the scope as in the OpenAI API.
"""
import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, model_validator

from prefixcache.cache.policy import Breakpoint
from prefixcache.engine.sequence import SamplingParams
from prefixcache.prompt import Prompt, fields, render
from prefixcache.server.auth import client_salt
from prefixcache.server.caps import MAX_MESSAGES, MAX_METADATA, MAX_PARTS, MAX_STOP_SEQUENCES, MAX_TOOLS, Word, capped
from prefixcache.server.errors import ApiError, Strict
from prefixcache.server.generation import Generation
from prefixcache.server.principal import Principal
from prefixcache.server.state import current, principal
from prefixcache.server.tools import Holdback, ToolUse

MAX_BREAKPOINTS = 4

router = APIRouter()


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class Block(Strict):
    type: Literal["text", "tool_use", "tool_result"]
    text: str | None = None
    id: str | None = None  # tool_use; ignored: calls and results are rendered in order, without ids
    caller: dict | None = None  # tool_use; ignored: who made the call (the model, here)
    toolset_name: str | None = None  # tool_use; ignored: our tools have no toolsets
    citations: list | None = None  # text; ignored: nothing here cites
    name: str | None = None  # tool_use
    input: Any = None  # tool_use
    tool_use_id: str | None = None  # tool_result; ignored, as id
    content: str | capped("Block", MAX_PARTS) | None = None  # tool_result
    is_error: Literal[False] | None = None  # tool_result: an error result would need its own rendering
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def text_blocks_have_text(self) -> "Block":
        if self.type == "text" and self.text is None:
            raise ValueError("text blocks need a `text` field")
        return self


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | capped(Block, MAX_PARTS) = Field(min_length=1)


class Tool(Strict):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool
    disable_parallel_tool_use: bool | None = None  # a forced call is one call; with auto, one call per reply line

    @model_validator(mode="after")
    def name_with_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type tool, and only then")
        return self


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: capped(Message, MAX_MESSAGES, 1)
    system: str | capped(Block, MAX_PARTS) | None = None
    tools: capped(Tool, MAX_TOOLS) | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: capped(Word, MAX_STOP_SEQUENCES) | None = None
    stream: bool | None = False
    metadata: Annotated[dict[str, Any], Field(max_length=MAX_METADATA)] | None = None  # informational
    service_tier: str | None = None  # informational: one tier here
    cache_control: CacheControl | None = None
    cache_salt: str | None = None
    prompt_cache_key: str | None = None
    speculative: bool | None = None  # extension: false opts this request out of speculative decoding

    @property
    def salt(self) -> str:
        return client_salt(self.cache_salt, self.prompt_cache_key)


def build_prompt(tokenizer, req: MessagesRequest) -> tuple[Prompt, list[Breakpoint]]:
    """Render tools -> system -> messages; breakpoints in that order."""
    request_fields = fields(req.model_dump(exclude_unset=True))
    ttls = [f.breakpoint for f in request_fields if f.breakpoint]
    if len(ttls) > MAX_BREAKPOINTS:
        raise ApiError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                            f"Found {len(ttls)}.")
    if "5m" in ttls and "1h" in ttls[ttls.index("5m"):]:
        raise ApiError(400, "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block")
    prompt = render(tokenizer, request_fields)
    return prompt, [Breakpoint(p, t) for p, t in prompt.breakpoints if p > 0]


def tool_use(req: MessagesRequest) -> ToolUse | None:
    """How the reply may call tools; None when it may not (no tools, or tool_choice none)."""
    choice = req.tool_choice
    if choice is not None and not req.tools:
        raise ApiError(400, "tool_choice needs tools")
    if not req.tools or (choice and choice.type == "none"):
        return None
    tools = {t.name: t.input_schema for t in req.tools}
    if choice and choice.type == "tool" and choice.name not in tools:
        raise ApiError(400, f"tool_choice names {choice.name!r}, which is not in tools")
    force = {"any": list(tools), "tool": [choice.name]}.get(choice.type) if choice else None
    return ToolUse(tools, force)


def tool_blocks(use: ToolUse | None, text: str) -> list[dict] | None:
    """The reply as tool_use blocks, if it is one or more calls to the request's tools."""
    calls = use.calls(text) if use else None
    return [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": args}
            for name, args in calls] if calls else None


def usage(gen: Generation) -> dict:
    w = gen.cache_write
    w5, w1 = w.get("5m", 0), w.get("1h", 0)
    read = gen.cached_tokens
    return {"input_tokens": gen.prompt_tokens - read - w5 - w1, "cache_creation_input_tokens": w5 + w1,
            "cache_read_input_tokens": read, "cache_read_input_tokens_by_tier": gen.report.cached_by_tier,
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
async def messages(request: Request, req: MessagesRequest, caller: Principal = Depends(principal)):
    server = current(request)
    adapter = server.check_model(req.model)
    if req.max_tokens >= server.engine.max_model_len:
        raise ApiError(400, f"max_tokens must be below the context window ({server.engine.max_model_len})")
    stops = [s for s in req.stop_sequences or [] if s]

    def prepare():
        use = tool_use(req)
        params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=req.top_p or 1.0, top_k=req.top_k or 0, max_tokens=req.max_tokens, stop=stops,
                                guide=use.guide() if use else None, speculative=req.speculative is not False)
        return *build_prompt(server.tokenizer, req), use, params

    prompt, breakpoints, use, params = await server.prepare(caller, prepare)
    gen = await server.generate(request, "anthropic", caller, prompt.token_ids, params, req.salt, breakpoints,
                                where=prompt.where, adapter=adapter)
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
               "model": adapter or server.model_name}

    if not req.stream:
        text = (await gen.texts())[0]
        blocks = tool_blocks(use, text)
        reason, seq = ("tool_use", None) if blocks else stop_reason(server.tokenizer, gen, stops)
        return JSONResponse({**message, "content": blocks or [{"type": "text", "text": text}], "stop_reason": reason,
                             "stop_sequence": seq, "usage": usage(gen)}, headers=gen.header())

    def sse(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    async def events():
        try:
            yield sse("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                                    "stop_sequence": None, "usage": usage(gen)}})
            hold, opened = Holdback() if use else None, False  # with tools, the text block opens once text is sure
            try:
                async for delta in gen.deltas():
                    text = hold.feed(delta.text) if hold else delta.text
                    if text or not (hold or opened):
                        if not opened:
                            yield sse("content_block_start",
                                      {"index": 0, "content_block": {"type": "text", "text": ""}})
                            opened = True
                        yield sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
            except ApiError as e:  # the request failed after its stream began: Anthropic's error event
                gen.stream_failed(e)
                yield f"event: error\ndata: {json.dumps(e.anthropic_body())}\n\n"
                return
            held = hold.held if hold else ""
            blocks = tool_blocks(use, held)
            if not blocks and (held or not opened):
                if not opened:
                    yield sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    opened = True
                yield sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": held}})
            if opened:
                yield sse("content_block_stop", {"index": 0})
            for k, block in enumerate(blocks or [], start=int(opened)):
                yield sse("content_block_start", {"index": k, "content_block": {**block, "input": {}}})
                yield sse("content_block_delta", {"index": k, "delta": {"type": "input_json_delta",
                                                                        "partial_json": json.dumps(block["input"])}})
                yield sse("content_block_stop", {"index": k})
            reason, seq = ("tool_use", None) if blocks else stop_reason(server.tokenizer, gen, stops)
            yield sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(gen)})
            yield sse("message_stop", {})
        finally:
            gen.close()

    return StreamingResponse(events(), media_type="text/event-stream", headers=gen.header())
