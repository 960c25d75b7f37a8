"""OpenAI-compatible endpoints: POST /v1/chat/completions and /v1/completions, streaming or not.

The request bodies are in openai_requests.py; chat requests (tools, tool calls, content parts) are rendered by
prefixcache/prompt.py. A Reply renders one response: whole, or as server-sent events.
"""
import json
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from prefixcache.engine.sequence import SamplingParams, best
from prefixcache.server.body import json_body
from prefixcache.server.errors import ApiError
from prefixcache.server.generation import Generation
from prefixcache.server.logprobs import CompletionLogprobs, TokenText, chat_logprobs, check_logprobs, prompt_logprobs
from prefixcache.server.openai_requests import ChatRequest, Common, CompletionRequest, completion_prompt
from prefixcache.server.principal import Principal
from prefixcache.server.state import current, principal
from prefixcache.server.tools import Holdback

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatRequest, caller: Principal = Depends(principal)):
    return await complete(request, body, caller, chat=True)


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest, caller: Principal = Depends(principal)):
    return await complete(request, body, caller, chat=False)


async def complete(request: Request, req: Common, caller: Principal, chat: bool):
    server = current(request)
    adapter = server.check_model(req.model)
    req.check_samples(server.engine.config.max_num_seqs)

    def prepare():
        rendered = req.rendered(server.tokenizer) if chat else None
        prompt = rendered.token_ids if rendered else completion_prompt(server.tokenizer, req,
                                                                        server.engine.max_model_len)
        return rendered, prompt, req.sampling(server.tokenizer, server.engine.max_model_len)

    rendered, prompt, params = await server.prepare(caller, prepare)
    check_logprobs(params, len(prompt), params.max_tokens or server.engine.config.max_tokens, not chat)
    gen = await server.generate(request, "openai", caller, prompt, params, req.salt,
                                where=rendered.where if rendered else None, adapter=adapter)
    reply = Reply(req, gen, params, prompt, server.tokenizer, adapter or server.model_name, chat)
    return reply.stream() if req.stream else await reply.whole()


def usage(gen: Generation) -> dict:
    """The prompt counts once however many samples share it; completion tokens are every sample's."""
    completion = gen.completion_tokens
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": completion,
            "total_tokens": gen.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens,
                                      "cached_tokens_by_tier": gen.report.cached_by_tier},
            "completion_tokens_details": {"accepted_prediction_tokens": gen.accepted_draft_tokens}}


class Reply:
    """One response: its choices, their logprobs and tool calls, as one body or as a stream of chunks."""

    def __init__(self, req: Common, gen: Generation, params: SamplingParams, prompt: list[int], tokenizer,
                 model: str, chat: bool):
        self.req, self.gen, self.params, self.prompt, self.chat = req, gen, params, prompt, chat
        self.tt = TokenText(tokenizer, as_ids=bool(req.return_tokens_as_token_ids))
        self.offsets = [CompletionLogprobs(self.tt) for _ in range(params.n)]  # each choice's text offsets
        self.use = req.tool_use() if chat else None
        self.echo = not chat and req.echo  # completions: each choice starts with the prompt (and its logprobs)
        self.prompt_text = tokenizer.decode(prompt) if self.echo else ""
        self.continued = req.echoed() if chat else ""  # chat: the final assistant message the reply continues
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id or uuid.uuid4().hex}"
        self.base = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model}

    async def whole(self) -> Response:
        gen, req, chat = self.gen, self.req, self.chat
        texts = await gen.texts()
        prompt_lps = prompt_logprobs(self.tt, gen.prompt_logprobs or []) if req.prompt_logprobs is not None else None
        choices = []
        for i, out in enumerate(best(gen.outputs, self.params.n)):
            tokens, entries = out.token_ids, out.logprobs or []
            if self.echo:
                tokens, entries = self.prompt + tokens, (gen.prompt_logprobs or []) + entries
            text = self.prompt_text + self.continued + texts[out.index]
            choices.append(self._choice(i, text, out.finish_reason, self._logprobs(i, tokens, entries),
                                        calls=self._tool_calls(text)))
            if req.return_token_ids:  # vLLM's places: the prompt's per choice in completions, once in chats
                choices[-1].update({"token_ids": out.token_ids, **({} if chat else {"prompt_token_ids": self.prompt})})
            if not chat and prompt_lps is not None:
                choices[-1]["prompt_logprobs"] = prompt_lps
        ids = {"prompt_token_ids": self.prompt} if chat and req.return_token_ids else {}
        if chat and prompt_lps is not None:
            ids["prompt_logprobs"] = prompt_lps
        body = await json_body({**self.base, **ids, "choices": choices, "usage": usage(gen)})
        return Response(body, media_type="application/json", headers=gen.header())

    def stream(self) -> StreamingResponse:
        return StreamingResponse(self._events(), media_type="text/event-stream", headers=self.gen.header())

    async def _events(self):
        gen, n = self.gen, self.params.n
        try:
            for i in range(n):  # streams have no best_of > n: sample i is choice i
                if self.chat:
                    yield self._sse([self._choice(i, self.continued or None, None, first=True)])
                elif self.echo:
                    lp = self._logprobs(i, self.prompt, gen.prompt_logprobs or [])
                    yield self._sse([self._choice(i, self.prompt_text, None, lp)])
            holds = [Holdback() if self.use else None for _ in range(n)]
            try:
                async for d in gen.deltas():
                    lp = self._logprobs(d.index, [e.token for e in d.logprobs], d.logprobs)
                    text = holds[d.index].feed(d.text) if self.use else d.text
                    if text or lp:
                        yield self._sse([self._choice(d.index, text, None, lp)])
            except ApiError as e:  # the request failed after its stream began: say why, in the stream (as vLLM)
                gen.stream_failed(e)
                yield f"data: {json.dumps(e.openai_body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            for i, out in enumerate(gen.outputs):
                held = holds[i].held if self.use else ""
                calls = self._tool_calls(held, streamed=True)
                if held and not calls:
                    yield self._sse([self._choice(i, held, None)])
                yield self._sse([self._choice(i, None, out.finish_reason, calls=calls)])
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield self._sse([], usage(gen))
            yield "data: [DONE]\n\n"
        finally:
            gen.close()  # a disconnect before the first delta: abort the sequence

    def _sse(self, choices: list[dict], use: dict | None = None) -> str:
        chunk = {**self.base, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        return f"data: {json.dumps({**chunk, 'choices': choices, 'usage': use}, default=list)}\n\n"

    def _logprobs(self, i: int, tokens: list[int], entries: list) -> dict | None:
        if self.params.logprobs is None:
            return None
        return chat_logprobs(self.tt, entries) if self.chat else self.offsets[i](tokens, entries)

    def _choice(self, i: int, text: str | None, finish: str | None, lp: dict | None = None, first: bool = False,
                calls: list | None = None) -> dict:
        if not self.chat:
            return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lp}
        if calls:
            finish = "tool_calls" if finish == "stop" else finish
        if not self.req.stream:
            message = {"role": "assistant", "content": None if calls else text}
            return {"index": i, "message": {**message, **({"tool_calls": calls} if calls else {})},
                    "finish_reason": finish, "logprobs": lp}
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": i, "delta": {**delta, **({"tool_calls": calls} if calls else {})}, "finish_reason": finish,
                "logprobs": lp}

    def _tool_calls(self, text: str, streamed: bool = False) -> list[dict] | None:
        """The reply as OpenAI tool_calls, if it is one or more calls to the request's tools."""
        calls = self.use.calls(text) if self.use else None
        return [{**({"index": k} if streamed else {}), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                for k, (name, args) in enumerate(calls)] if calls else None
