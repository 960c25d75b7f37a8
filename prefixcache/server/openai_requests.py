"""OpenAI request bodies (chat and completions) and what they ask of the engine: the prompt, the sampling
parameters and the guide. A field not declared here is a 400 naming it (server/fields.py has the table);
`prompt_cache_retention` is accepted, entries live until evicted either way; `cache_salt` and `prompt_cache_key`
both narrow the cache scope (combined when both are given). Without max_tokens / max_completion_tokens a request
generates at most the engine's Config.max_tokens.
"""
import inspect
import json
from typing import Annotated, Literal

import jinja2
from pydantic import Field, ValidationInfo, field_validator

from prefixcache.engine.guide import Guide
from prefixcache.engine.sequence import SamplingParams
from prefixcache.prompt import Prompt, fields, render
from prefixcache.server.auth import client_salt
from prefixcache.server.caps import MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_METADATA, MAX_STOP, MAX_TOOLS, Word, capped
from prefixcache.server.errors import ApiError
from prefixcache.server.extensions import Extensions
from prefixcache.server.openai_types import Message, NamedToolChoice, ResponseFormat, StreamOptions, Tool
from prefixcache.server.tools import ToolUse


class Common(Extensions):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: Word | capped(Word, MAX_STOP) | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1)  # at most the engine's max_num_seqs (check_samples)
    logit_bias: Annotated[dict[int, Annotated[float, Field(ge=-100, le=100)]],  # token ids of the vocabulary
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # informational
    safety_identifier: str | None = None  # informational
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA)] | None = None  # informational
    service_tier: str | None = None  # informational: one tier here
    store: bool | None = None  # informational: nothing is stored
    response_format: ResponseFormat | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    cache_salt: str | None = None
    speculative: bool | None = None  # extension: false opts this request out of speculative decoding

    def check_samples(self, max_num_seqs: int) -> None:
        """`n` and `best_of` against the engine's running slots (a sample is a sequence), before any work is done."""
        for name in ("n", "best_of"):
            value = getattr(self, name, None)
            if value is not None and value > max_num_seqs:
                raise ApiError(400, f"{name}: at most {max_num_seqs} (the server's max_num_seqs), got {value}",
                               param=name)

    def sampling(self, tokenizer, max_model_len: int) -> SamplingParams:
        self.refuse_unstreamable()
        max_tokens = self.max_completion_tokens or self.max_tokens  # None: the engine's default
        if max_tokens is not None and max_tokens >= max_model_len:
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
    messages: capped(Message, MAX_MESSAGES, 1)
    tools: capped(Tool, MAX_TOOLS) | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced call is one call; with auto, one call per reply line
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool | None = None  # vLLM extension: default true
    continue_final_message: bool | None = None  # vLLM extension: the last message left open, to be continued
    chat_template_kwargs: Annotated[dict, Field(max_length=MAX_METADATA)] | None = None  # vLLM's: to the template
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
