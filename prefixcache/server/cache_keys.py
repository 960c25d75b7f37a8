"""POST /v1/cache/keys: the prefix-cache keys a request would look up, for a cache-aware router.

The body names the API route and carries the request as the client sent it; the caller's own API key decides the
tenant, exactly as on the route itself, so a router learns keys without knowing tenants or holding keys of its own.
Keys are hashes chained from the caller's scope: they tell the caller nothing about anyone else's cache. A prompt
the route itself would refuse as longer than the context gets its 400 here too, before any key is made. A lookup is
not charged to the caller's rate limit (our router makes one for every request it routes, which is charged where it
runs); its work is bounded by the context and by the tenant's turn on the preparing thread.
"""
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from prefixcache.server.anthropic import MessagesRequest, build_prompt
from prefixcache.server.errors import Strict, invalid
from prefixcache.server.openai_requests import ChatRequest, CompletionRequest, completion_prompt
from prefixcache.server.principal import Principal
from prefixcache.server.state import authenticated, current

router = APIRouter()


class KeysRequest(Strict):
    path: Literal["/v1/chat/completions", "/v1/completions", "/v1/messages"]
    body: dict


@router.post("/v1/cache/keys")
async def cache_keys(request: Request, req: KeysRequest, caller: Principal = Depends(authenticated)):
    server = current(request)
    tokenizer = server.tokenizer

    def prepare() -> tuple[list[int], str]:
        try:
            body = {"/v1/messages": MessagesRequest, "/v1/chat/completions": ChatRequest,
                    "/v1/completions": CompletionRequest}[req.path].model_validate(req.body)
        except ValidationError as e:
            raise invalid([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e
        if isinstance(body, MessagesRequest):
            return build_prompt(tokenizer, body)[0].token_ids, body.salt
        if isinstance(body, ChatRequest):
            return body.rendered(tokenizer).token_ids, body.salt
        return completion_prompt(tokenizer, body, server.engine.max_model_len), body.salt

    prompt, salt = await server.prepare(caller, prepare)
    server.check_context(prompt, param="body")
    scope = caller.scope(salt)
    return {"block_size": server.engine.config.block_size, "keys": server.engine.cache.prefix_keys(prompt, scope)}
