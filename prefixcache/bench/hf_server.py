"""The HF transformers baseline as a minimal OpenAI-compatible server, so the same driver measures it.

What a Python user would write: `model.generate` on the same weights (fp32), one request at a time, no
cross-request cache. Prompts are rendered with prefixcache's own chat rendering, so both servers see the same
token ids. Streams one chunk per generated token. Run: python -m prefixcache.bench.hf_server --port P
"""
import argparse
import asyncio
import json
import threading

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from prefixcache.config import Config
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import converted_folder
from prefixcache.server.openai_requests import ChatRequest


class QueueStreamer(BaseStreamer):
    """generate() calls put() with the prompt first, then with each new token; end() when done."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, int(value.reshape(-1)[0]))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def create_app(folder: str) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    name = "hf-transformers"
    lock = asyncio.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = ChatRequest(**await request.json())
        ids = req.rendered(tokenizer).token_ids
        max_tokens = req.max_completion_tokens or req.max_tokens or Config.max_tokens
        base = {"id": "chatcmpl-hf", "object": "chat.completion.chunk", "model": name}

        def sse(choices: list, usage: dict | None = None) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, 'usage': usage})}\n\n"

        async def events():
            async with lock:
                queue: asyncio.Queue = asyncio.Queue()
                kw = dict(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                          pad_token_id=tokenizer.eos_token_id,
                          streamer=QueueStreamer(asyncio.get_running_loop(), queue))
                threading.Thread(target=model.generate, kwargs=kw, daemon=True).start()
                n = 0
                while (token := await queue.get()) is not None:
                    n += 1
                    text = tokenizer.decode([token], skip_special_tokens=True)
                    if text:
                        yield sse([{"index": 0, "delta": {"content": text}, "finish_reason": None}])
            yield sse([{"index": 0, "delta": {}, "finish_reason": "length" if n >= max_tokens else "stop"}])
            if req.stream_options and req.stream_options.include_usage:
                yield sse([], {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n,
                               "prompt_tokens_details": {"cached_tokens": 0}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--model", default="", help="HF folder; default: the converted default GGUF")
    args = ap.parse_args()
    uvicorn.run(create_app(args.model or converted_folder(default_model_path())), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
