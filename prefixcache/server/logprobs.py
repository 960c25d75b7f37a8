"""Logprobs in OpenAI's two formats. Values are log_softmax of the model's raw logits, before penalties, biases
and temperature (vLLM's default): what the model thinks, whatever the sampler then did with it. A structured-output
guide's mask applies before them, as in vLLM: tokens the grammar forbids show FLOOR (JSON has no -inf).

A token's `bytes` are its own UTF-8 bytes (for byte-level BPE, possibly part of one character), and its text is
those bytes decoded, with U+FFFD for an incomplete character, as OpenAI and vLLM show it.
"""
from dataclasses import dataclass

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode

from prefixcache.engine.sequence import SamplingParams, TokenLogprob
from prefixcache.server.body import Items
from prefixcache.server.caps import MAX_LOGPROB_ENTRIES
from prefixcache.server.errors import ApiError

BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE's printable stand-ins -> bytes
FLOOR = -9999.0  # vLLM's value for a logprob of -inf


def check_logprobs(params: SamplingParams, prompt_tokens: int, max_tokens: int, per_choice_prompt: bool) -> None:
    """A 400 naming the field if the response could carry more than MAX_LOGPROB_ENTRIES logprob entries: each output
    token's and its alternatives', in every sample, and the prompt's (in every choice, for completions)."""
    prompt = (params.prompt_logprobs + 1) * prompt_tokens * (params.n if per_choice_prompt else 1) \
        if params.prompt_logprobs is not None else 0
    output = (params.logprobs + 1) * max_tokens * params.n if params.logprobs is not None else 0
    if prompt + output > MAX_LOGPROB_ENTRIES:
        field = "prompt_logprobs" if prompt >= output else "logprobs"
        raise ApiError(400, f"{field}: this request's response would carry {prompt + output:,} logprob entries "
                            f"(the tokens' and their alternatives', in every choice); at most {MAX_LOGPROB_ENTRIES:,}",
                       param=field)


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class TokenText:
    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: a token shows as "token_id:N"
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
        self.texts: dict[int, str] = {}  # a body names the same tokens many times (each prompt token's top 20)

    def bytes(self, token: int) -> bytes:
        if self.as_ids:
            return f"token_id:{token}".encode()
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if self.byte_level and all(c in BYTE_OF for c in piece):
            return bytes(BYTE_OF[c] for c in piece)
        return self.tokenizer.decode([token]).encode()

    def text(self, token: int) -> str:
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.bytes(token).decode("utf-8", errors="replace")
        return text


def chat_logprobs(tt: TokenText, entries: list[TokenLogprob]) -> dict:
    """`choices[].logprobs` of a chat completion (or of a chunk: the entries of its tokens)."""
    def item(token: int, logprob: float) -> dict:
        return {"token": tt.text(token), "logprob": _value(logprob), "bytes": list(tt.bytes(token))}

    def entry(i: int) -> dict:
        e = entries[i]
        return {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}

    return {"content": Items(len(entries), entry), "refusal": None}


@dataclass
class CompletionLogprobs:
    """`choices[].logprobs` of a text completion; `offset` runs on across a stream's chunks."""

    tt: TokenText
    offset: int = 0

    def __call__(self, tokens: list[int], entries: list[TokenLogprob | None]) -> dict:
        """entries[i] is tokens[i]'s, or None (an echoed prompt's first token has no logprob)."""
        texts = [self.tt.text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        def top(i: int) -> dict | None:
            e = entries[i]
            return e and {self.tt.text(t): _value(lp) for t, lp in (*e.top, (e.token, e.logprob))}

        return {"tokens": texts, "token_logprobs": [e and _value(e.logprob) for e in entries],
                "top_logprobs": Items(len(entries), top), "text_offset": offsets}


def prompt_logprobs(tt: TokenText, entries: list[TokenLogprob | None]) -> Items:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), {token id: {logprob, rank, decoded_token}} for
    the most likely tokens and the prompt's own."""
    def item(logprob: float, rank: int | None, token: int) -> dict:
        return {"logprob": _value(logprob), "rank": rank, "decoded_token": tt.text(token)}

    def entry(i: int) -> dict | None:
        e = entries[i]
        return None if e is None else {**{str(t): item(lp, r, t) for r, (t, lp) in enumerate(e.top, 1)},
                                       str(e.token): item(e.logprob, e.rank, e.token)}

    return Items(len(entries), entry)
