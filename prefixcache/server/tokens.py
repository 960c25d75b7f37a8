"""vLLM's token endpoints: POST /tokenize (a prompt, or chat messages rendered as the chat route renders them)
and POST /detokenize."""

from fastapi import APIRouter, Depends, Request
from pydantic import Field, model_validator

from prefixcache.prompt import fields, render
from prefixcache.server.auth import Principal, principal
from prefixcache.server.errors import ApiError, Strict
from prefixcache.server.openai import Message

router = APIRouter()


class TokenizeRequest(Strict):
    model: str
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[dict] | None = None
    add_special_tokens: bool = True  # prompt only
    add_generation_prompt: bool = True  # messages only

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
    server = request.app.state.server
    server.check_model(req.model)
    if req.prompt is not None:
        ids = server.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        body = req.model_dump(include={"messages", "tools"}, exclude_none=True)
        ids = render(server.tokenizer, fields(body), req.add_generation_prompt).token_ids
    return {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request, req: DetokenizeRequest, caller: Principal = Depends(principal)):
    server = request.app.state.server
    server.check_model(req.model)
    vocab = server.engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise ApiError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    return {"prompt": server.tokenizer.decode(req.tokens)}
