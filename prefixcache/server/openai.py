"""OpenAI-compatible endpoints: POST /v1/chat/completions and /v1/completions, streaming or not.

A field not declared here is a 400 naming it (server/fields.py has the table). `prompt_cache_retention` is
accepted; entries live until evicted either way. `cache_salt` and `prompt_cache_key` both narrow the cache scope (combined when both are given).
Without max_tokens / max_completion_tokens a request generates at most DEFAULT_MAX_TOKENS tokens.
Chat requests (tools, tool calls, content parts) are rendered by prefixcache/prompt.py.
"""
import json
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, model_validator

from prefixcache.engine.sequence import SamplingParams
from prefixcache.prompt import fields, render
from prefixcache.server.auth import Principal, client_salt, principal
from prefixcache.server.errors import ApiError, Strict
from prefixcache.server.generation import Generation

DEFAULT_MAX_TOKENS = 256
MAX_STOP = 4  # stop sequences, as OpenAI allows

router = APIRouter()


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str | None = None  # ignored: calls and results are rendered in order, without ids
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # ignored: the chat template has no speaker names
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # ignored, as ToolCall.id

    @model_validator(mode="after")
    def has_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content is required in a {self.role} message")
        return self


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: nothing to obfuscate on a local server


class Common(Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    n: Literal[1] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # informational
    safety_identifier: str | None = None  # informational
    metadata: dict[str, str] | None = None  # informational
    service_tier: str | None = None  # informational: one tier here
    store: bool | None = None  # informational: nothing is stored
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    cache_salt: str | None = None

    def sampling(self, max_model_len: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS
        if max_tokens >= max_model_len:
            raise ApiError(400, f"max_tokens must be below the context window ({max_model_len})", param="max_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(temperature=temperature, top_p=self.top_p or 1.0, max_tokens=max_tokens,
                              stop=[s for s in stop if s], seed=self.seed)

    @property
    def salt(self) -> str:
        return client_salt(self.cache_salt, self.prompt_cache_key)


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict] | None = None


class CompletionRequest(Common):
    prompt: str | list[int] | list[str] | list[list[int]]


def completion_prompt(tokenizer, req: CompletionRequest) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        p = p[0]
    if not p:
        raise ApiError(400, "prompt is empty", param="prompt")
    return tokenizer.encode(p) if isinstance(p, str) else list(p)


def usage(gen: Generation) -> dict:
    completion = len(gen.output.token_ids) if gen.output else 0
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": completion,
            "total_tokens": gen.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


async def complete(request: Request, req: Common, caller: Principal, chat: bool):
    server = request.app.state.server
    server.check_model(req.model)
    rendered = render(server.tokenizer, fields(req.model_dump(exclude_unset=True))) if chat else None
    prompt = rendered.token_ids if rendered else completion_prompt(server.tokenizer, req)
    params = req.sampling(server.engine.max_model_len)
    gen = await server.generate(request, "openai", caller, prompt, params, req.salt,
                                where=rendered.where if rendered else None)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    base = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": server.model_name}

    def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
        if not chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if not req.stream:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                    "logprobs": None}
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    if not req.stream:
        text = await gen.text()
        return JSONResponse({**base, "choices": [choice(text, gen.output.finish_reason)], "usage": usage(gen)},
                            headers=gen.header())

    chunk = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

    def sse(choices: list[dict], use: dict | None = None) -> str:
        return f"data: {json.dumps({**chunk, 'choices': choices, 'usage': use})}\n\n"

    async def events():
        try:
            if chat:
                yield sse([choice(None, None, first=True)])
            async for delta in gen.deltas():
                yield sse([choice(delta, None)])
            yield sse([choice(None, gen.output.finish_reason)])
            if req.stream_options and req.stream_options.include_usage:
                yield sse([], usage(gen))
            yield "data: [DONE]\n\n"
        finally:
            gen.close()  # a disconnect before the first delta: abort the sequence

    return StreamingResponse(events(), media_type="text/event-stream", headers=gen.header())


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatRequest, caller: Principal = Depends(principal)):
    return await complete(request, body, caller, chat=True)


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest, caller: Principal = Depends(principal)):
    return await complete(request, body, caller, chat=False)
