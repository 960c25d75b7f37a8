"""POST /v1/cache/keys: the prefix-cache keys a request would look up, for a cache-aware router.

The body names the API route and carries the request as the client sent it; the caller's own API key decides the
tenant, exactly as on the route itself, so a router learns keys without knowing tenants or holding keys of its own.
Keys are hashes chained from the caller's scope: they tell the caller nothing about anyone else's cache. A prompt
the route itself would refuse as longer than the context gets its 400 here too, before any key is made.
"""
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from prefixcache.server.anthropic import MessagesRequest, build_prompt
from prefixcache.server.errors import ApiError, Strict, invalid
from prefixcache.server.openai_requests import ChatRequest, CompletionRequest, completion_prompt
from prefixcache.server.principal import Principal
from prefixcache.server.state import current, principal

router = APIRouter()


class KeysRequest(Strict):
    path: Literal["/v1/chat/completions", "/v1/completions", "/v1/messages"]
    body: dict


@router.post("/v1/cache/keys")
async def cache_keys(request: Request, req: KeysRequest, caller: Principal = Depends(principal)):
    server = current(request)
    tokenizer = server.tokenizer
    try:
        if req.path == "/v1/messages":
            msg = MessagesRequest.model_validate(req.body)
            prompt, salt = build_prompt(tokenizer, msg)[0].token_ids, msg.salt
        elif req.path == "/v1/chat/completions":
            chat = ChatRequest.model_validate(req.body)
            prompt, salt = chat.rendered(tokenizer).token_ids, chat.salt
        else:
            completion = CompletionRequest.model_validate(req.body)
            prompt, salt = completion_prompt(tokenizer, completion, server.engine.max_model_len), completion.salt
    except ValidationError as e:
        raise invalid([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e
    if len(prompt) >= server.engine.max_model_len:
        raise ApiError(400, f"prompt has {len(prompt)} tokens; the context window is {server.engine.max_model_len}",
                       param="body", code="context_length_exceeded")
    scope = caller.scope(salt)
    return {"block_size": server.engine.config.block_size, "keys": server.engine.cache.prefix_keys(prompt, scope)}
