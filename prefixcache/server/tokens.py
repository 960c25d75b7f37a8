"""vLLM's token endpoints: POST /tokenize (a prompt, or chat messages rendered as the chat route renders them),
POST /detokenize, and the renderer's POST /v1/completions/render and /v1/chat/completions/render.

A render takes the body its generation route takes and answers with what that route would prefill: vLLM's
GenerateRequest (`token_ids`, `sampling_params`, `model`, `request_id`). Gateways that route by KV events
(vllm-router's kv_aware, llm-d's precise prefix scorer) tokenize through it. It tells nothing about the cache.
"""
import uuid
from dataclasses import fields as dataclass_fields

from fastapi import APIRouter, Depends, Request
from pydantic import Field, ValidationError, model_validator

from prefixcache.server.errors import ApiError, Strict, invalid
from prefixcache.server.openai_requests import ChatRequest, Common, CompletionRequest, completion_prompt
from prefixcache.server.openai_types import Message
from prefixcache.server.principal import Principal
from prefixcache.server.state import current, principal

router = APIRouter()


class TokenizeRequest(Strict):
    model: str
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[dict] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool | None = None  # messages only, as on the chat route
    continue_final_message: bool | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(Strict):
    model: str
    tokens: list[int] = Field(min_length=1)


@router.post("/tokenize")
async def tokenize(request: Request, req: TokenizeRequest, caller: Principal = Depends(principal)):
    server = current(request)
    server.check_model(req.model)
    if req.prompt is not None:
        ids = await server.prepare(caller, lambda: server.tokenizer.encode(
            req.prompt, add_special_tokens=req.add_special_tokens is not False))
    else:
        chat = {"messages", "tools", "add_special_tokens", "add_generation_prompt", "continue_final_message",
                "chat_template_kwargs"}
        try:
            body = ChatRequest.model_validate({"model": req.model, **req.model_dump(include=chat, exclude_none=True)})
        except ValidationError as e:
            raise invalid([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e
        ids = await server.prepare(caller, lambda: body.rendered(server.tokenizer).token_ids)
    server.charge(caller, len(ids))
    strs = {"token_strs": server.tokenizer.convert_ids_to_tokens(ids)} if req.return_token_strs else {}
    return {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids, **strs}


@router.post("/detokenize")
async def detokenize(request: Request, req: DetokenizeRequest, caller: Principal = Depends(principal)):
    server = current(request)
    server.check_model(req.model)
    vocab = server.engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise ApiError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    return {"prompt": server.tokenizer.decode(req.tokens)}


@router.post("/v1/completions/render")
async def render_completion(request: Request, req: CompletionRequest, caller: Principal = Depends(principal)):
    server = current(request)
    server.check_model(req.model)
    req.check_samples(server.engine.config.max_num_seqs)
    out = await server.prepare(caller, lambda: generate_request(
        server, req, completion_prompt(server.tokenizer, req, server.engine.max_model_len), "cmpl"))
    server.charge(caller, len(out["token_ids"]))
    return [out]  # vLLM's: one per prompt


@router.post("/v1/chat/completions/render")
async def render_chat(request: Request, req: ChatRequest, caller: Principal = Depends(principal)):
    server = current(request)
    server.check_model(req.model)
    req.check_samples(server.engine.config.max_num_seqs)
    out = await server.prepare(caller, lambda: generate_request(server, req, req.rendered(server.tokenizer).token_ids,
                                                                 "chatcmpl"))
    server.charge(caller, len(out["token_ids"]))
    return out


def generate_request(server, req: Common, prompt: list[int], kind: str) -> dict:
    """vLLM's GenerateRequest for this request: its prompt's token ids and its sampling parameters (all but the
    structured-output guide, under the names vLLM gives them)."""
    params = req.sampling(server.tokenizer, server.engine.max_model_len)
    sampling = {f.name: getattr(params, f.name) for f in dataclass_fields(params) if f.name not in ("guide",
                                                                                                    "speculative")}
    return {"request_id": f"{kind}-{req.request_id or uuid.uuid4().hex}", "token_ids": prompt,
            "sampling_params": sampling, "model": server.model_name, "stream": bool(req.stream),
            "cache_salt": req.salt or None}
