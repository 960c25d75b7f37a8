"""OpenAI-compatible endpoints: POST /v1/chat/completions and /v1/completions, streaming or not.

A field not declared here is a 400 naming it (server/fields.py has the table). `prompt_cache_retention` is
accepted; entries live until evicted either way. `cache_salt` and `prompt_cache_key` both narrow the cache scope (combined when both are given).
Without max_tokens / max_completion_tokens a request generates at most DEFAULT_MAX_TOKENS tokens.
Chat requests (tools, tool calls, content parts) are rendered by prefixcache/prompt.py.
"""
import inspect
import json
import time
import uuid
from typing import Annotated, Literal

import jinja2
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationInfo, field_validator, model_validator

from prefixcache.engine.grammar import Guide
from prefixcache.engine.sequence import SamplingParams, best
from prefixcache.prompt import Prompt, fields, render
from prefixcache.server.auth import client_salt, principal
from prefixcache.server.errors import ApiError, Strict
from prefixcache.server.extensions import Extensions
from prefixcache.server.generation import Generation
from prefixcache.server.logprobs import CompletionLogprobs, TokenText, chat_logprobs, prompt_logprobs
from prefixcache.server.principal import Principal
from prefixcache.server.tools import Holdback, ToolUse

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


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # a forced call always follows the parameters' schema


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


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


class JsonSchema(Strict):
    name: str
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: nothing to obfuscate on a local server


class Common(Extensions):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1)  # at most the engine's max_num_seqs
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token ids of the vocabulary
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # informational
    safety_identifier: str | None = None  # informational
    metadata: dict[str, str] | None = None  # informational
    service_tier: str | None = None  # informational: one tier here
    store: bool | None = None  # informational: nothing is stored
    response_format: ResponseFormat | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    cache_salt: str | None = None
    speculative: bool | None = None  # extension: false opts this request out of speculative decoding

    def sampling(self, tokenizer, max_model_len: int) -> SamplingParams:
        self.refuse_unstreamable()
        max_tokens = self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS
        if max_tokens >= max_model_len:
            raise ApiError(400, f"max_tokens must be below the context window ({max_model_len})", param="max_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = 1.0 if self.temperature is None else self.temperature
        try:
            return SamplingParams(
                temperature=temperature, top_p=self.top_p or 1.0, max_tokens=max_tokens, stop=[s for s in stop if s],
                seed=self.seed, guide=self.guide(), n=self.n or 1, logit_bias=self.logit_bias or {},
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                speculative=self.speculative is not False, **self.extension_params(tokenizer),
                **self.logprob_params())
        except ValueError as e:
            raise ApiError(400, str(e))

    def logprob_params(self) -> dict:
        """The request's logprobs, prompt_logprobs and best_of, as SamplingParams names them."""
        return {}

    def guide(self) -> Guide | None:
        rf = self.response_format if self.response_format and self.response_format.type != "text" else None
        wanted = {"response_format": rf, **self.extension_guides()} if rf else self.extension_guides()
        if len(wanted) > 1:
            raise ApiError(400, f"give at most one guide; this request gives {', '.join(wanted)}",
                           param=list(wanted)[1])
        if not wanted:
            return None
        [(name, g)] = wanted.items()
        kind = name.removeprefix("structured_outputs.").removeprefix("guided_")
        if name == "response_format":
            schema = rf.json_schema
            return Guide("json_schema", json.dumps(schema.schema_)) if schema else Guide("json_object")
        if kind == "json":
            try:
                return Guide("json_schema", json.dumps(json.loads(g) if isinstance(g, str) else g))
            except json.JSONDecodeError:
                raise ApiError(400, f"{name}: a JSON schema, as an object or its JSON text", param=name) from None
        if kind == "json_object":
            return Guide("json_object")
        return Guide("regex", g) if kind == "regex" else Guide("choice", json.dumps(g))

    @property
    def salt(self) -> str:
        return client_salt(self.cache_salt, self.prompt_cache_key)


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced call is one call; with auto, one call per reply line
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool | None = None  # vLLM extension: default true
    continue_final_message: bool | None = None  # vLLM extension: the last message left open, to be continued
    chat_template_kwargs: dict | None = None  # vLLM extension: passed to the chat template
    echo: bool | None = None  # vLLM extension: a final assistant message's text starts the reply
    include_reasoning: bool | None = None  # informational: not a reasoning model
    separate_reasoning: bool | None = None  # SGLang's, informational: not a reasoning model
    stream_reasoning: bool | None = None  # SGLang's, informational: not a reasoning model

    @field_validator("top_logprobs")
    @classmethod
    def needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("logprobs must be true to use top_logprobs")
        return v

    def logprob_params(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None,
                "prompt_logprobs": self.prompt_logprobs}

    def rendered(self, tokenizer) -> Prompt:
        """The prompt the chat template makes of the messages and tools."""
        continued = bool(self.continue_final_message)
        own = set(inspect.signature(tokenizer.apply_chat_template).parameters)
        clash = next((k for k in self.chat_template_kwargs or {} if k in own or not k.isidentifier()), None)
        if clash is not None:
            raise ApiError(400, f"chat_template_kwargs: {clash!r} is not a chat template variable",
                           param="chat_template_kwargs")
        if continued and self.add_generation_prompt is not False:
            raise ApiError(400, "continue_final_message: add_generation_prompt (default true) and "
                           "continue_final_message cannot both be true", param="continue_final_message")
        try:
            return render(tokenizer, fields(self.model_dump(exclude_unset=True)),
                          generation_prompt=self.add_generation_prompt is not False,
                          continue_final=continued, add_special_tokens=bool(self.add_special_tokens),
                          template_kwargs=self.chat_template_kwargs or {})
        except (TypeError, ValueError, jinja2.TemplateError) as e:  # the template refused the kwargs or messages
            param = "chat_template_kwargs" if self.chat_template_kwargs else "messages"
            raise ApiError(400, f"{param}: the chat template failed on this request: {e}", param=param)

    def echoed(self) -> str:
        """vLLM's echo: the text of a final assistant message, which the reply continues."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        return last.content if isinstance(last.content, str) else "\n".join(p.text for p in last.content)

    def tool_use(self) -> ToolUse | None:
        """How the reply may call tools; None when it may not (no tools, or tool_choice none)."""
        if self.tool_choice is not None and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if not self.tools or self.tool_choice == "none":
            return None
        tools = {t.function.name: t.function.parameters or {} for t in self.tools}
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in tools:
                raise ApiError(400, f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools",
                               param="tool_choice")
            return ToolUse(tools, [self.tool_choice.function.name])
        return ToolUse(tools, list(tools) if self.tool_choice == "required" else None)

    def guide(self) -> Guide | None:
        use, other = self.tool_use(), super().guide()
        forced = use.guide() if use else None
        if forced and other:
            raise ApiError(400, "a required tool call cannot be combined with response_format or guided_*",
                           param="tool_choice")
        return forced or other


class CompletionRequest(Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False  # the prompt before the completion (with its logprobs, recomputed, if asked)
    best_of: int | None = Field(None, ge=1)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM extension: keep this many (-1: the window)
    truncation_side: Literal["left", "right"] | None = None  # vLLM extension: which end truncation keeps

    @field_validator("best_of")
    @classmethod
    def not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v > (info.data.get("n") or 1) and info.data.get("stream"):
            raise ValueError("best_of > n cannot be streamed: the best are known only at the end")
        return v

    def logprob_params(self) -> dict:
        echoed = self.logprobs if self.echo else None  # echo with logprobs gives the prompt's, in OpenAI's format
        if echoed is not None and self.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs: not with echo and logprobs, which give the prompt's logprobs",
                           param="prompt_logprobs")
        return {"logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs if echoed is None else echoed,
                "best_of": self.best_of}


def completion_prompt(tokenizer, req: CompletionRequest, max_model_len: int) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        p = p[0]
    if not p:
        raise ApiError(400, "prompt is empty", param="prompt")
    ids = tokenizer.encode(p, add_special_tokens=req.add_special_tokens is not False) if isinstance(p, str) else list(p)
    keep = max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    if not keep or len(ids) <= keep:
        return ids
    return ids[:keep] if req.truncation_side == "right" else ids[-keep:]


def usage(gen: Generation) -> dict:
    """The prompt counts once however many samples share it; completion tokens are every sample's."""
    completion = gen.completion_tokens
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": completion,
            "total_tokens": gen.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens,
                                      "cached_tokens_by_tier": gen.report.cached_by_tier},
            "completion_tokens_details": {"accepted_prediction_tokens": gen.accepted_draft_tokens}}


async def complete(request: Request, req: Common, caller: Principal, chat: bool):
    server = request.app.state.server
    server.check_model(req.model)
    rendered = req.rendered(server.tokenizer) if chat else None
    prompt = rendered.token_ids if rendered else completion_prompt(server.tokenizer, req, server.engine.max_model_len)
    params = req.sampling(server.tokenizer, server.engine.max_model_len)
    gen = await server.generate(request, "openai", caller, prompt, params, req.salt,
                                where=rendered.where if rendered else None)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id or uuid.uuid4().hex}"
    base = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": server.model_name}

    tt = TokenText(server.tokenizer, as_ids=bool(req.return_tokens_as_token_ids))
    offsets = [CompletionLogprobs(tt) for _ in range(params.n)]  # each choice's text offsets

    def logprobs(i: int, tokens: list[int], entries: list) -> dict | None:
        if params.logprobs is None:
            return None
        return chat_logprobs(tt, entries) if chat else offsets[i](tokens, entries)

    use = req.tool_use() if chat else None

    def choice(i: int, text: str | None, finish: str | None, lp: dict | None = None, first: bool = False,
               calls: list | None = None) -> dict:
        if not chat:
            return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lp}
        if calls:
            finish = "tool_calls" if finish == "stop" else finish
        if not req.stream:
            message = {"role": "assistant", "content": None if calls else text}
            return {"index": i, "message": {**message, **({"tool_calls": calls} if calls else {})},
                    "finish_reason": finish, "logprobs": lp}
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": i, "delta": {**delta, **({"tool_calls": calls} if calls else {})}, "finish_reason": finish,
                "logprobs": lp}

    def tool_calls(text: str, streamed: bool = False) -> list[dict] | None:
        """The reply as OpenAI tool_calls, if it is one or more calls to the request's tools."""
        calls = use.calls(text) if use else None
        return [{**({"index": k} if streamed else {}), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                for k, (name, args) in enumerate(calls)] if calls else None

    echo = not chat and req.echo  # completions: each choice starts with the prompt (and its logprobs)
    prompt_text = server.tokenizer.decode(prompt) if echo else ""
    continued = req.echoed() if chat else ""  # chat: the final assistant message the reply continues

    if not req.stream:
        texts = await gen.texts()
        prompt_lps = prompt_logprobs(tt, gen.prompt_logprobs or []) if req.prompt_logprobs is not None else None
        choices = []
        for i, out in enumerate(best(gen.outputs, params.n)):
            tokens, entries = out.token_ids, out.logprobs or []
            if echo:
                tokens, entries = prompt + tokens, (gen.prompt_logprobs or []) + entries
            text = prompt_text + continued + texts[out.index]
            choices.append(choice(i, text, out.finish_reason, logprobs(i, tokens, entries), calls=tool_calls(text)))
            if req.return_token_ids:  # vLLM's places: the prompt's per choice in completions, once in chats
                choices[-1].update({"token_ids": out.token_ids, **({} if chat else {"prompt_token_ids": prompt})})
            if not chat and prompt_lps is not None:
                choices[-1]["prompt_logprobs"] = prompt_lps
        ids = {"prompt_token_ids": prompt} if chat and req.return_token_ids else {}
        if chat and prompt_lps is not None:
            ids["prompt_logprobs"] = prompt_lps
        return JSONResponse({**base, **ids, "choices": choices, "usage": usage(gen)}, headers=gen.header())

    chunk = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

    def sse(choices: list[dict], use: dict | None = None) -> str:
        return f"data: {json.dumps({**chunk, 'choices': choices, 'usage': use})}\n\n"

    async def events():
        try:
            for i in range(params.n):  # streams have no best_of > n: sample i is choice i
                if chat:
                    yield sse([choice(i, continued or None, None, first=True)])
                elif echo:
                    yield sse([choice(i, prompt_text, None, logprobs(i, prompt, gen.prompt_logprobs or []))])
            holds = [Holdback() if use else None for _ in range(params.n)]
            try:
                async for d in gen.deltas():
                    lp = logprobs(d.index, [e.token for e in d.logprobs], d.logprobs)
                    text = holds[d.index].feed(d.text) if use else d.text
                    if text or lp:
                        yield sse([choice(d.index, text, None, lp)])
            except ApiError as e:  # the request failed after its stream began: say why, in the stream (as vLLM)
                gen.stream_failed(e)
                yield f"data: {json.dumps(e.openai_body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            for i, out in enumerate(gen.outputs):
                held = holds[i].held if use else ""
                calls = tool_calls(held, streamed=True)
                if held and not calls:
                    yield sse([choice(i, held, None)])
                yield sse([choice(i, None, out.finish_reason, calls=calls)])
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
