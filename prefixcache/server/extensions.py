"""vLLM's (and SGLang's) extensions to OpenAI's request fields, as both OpenAI endpoints take them: the fields,
the few accepted only at one value, and what the rest become (sampling parameters, guides). server/fields.py has
the table of what each does here; vLLM's OpenAI protocol (0.32) is where they come from."""
import json

from pydantic import Field, ValidationInfo, field_validator

from prefixcache.server.caps import MAX_BAD_WORDS, MAX_CHOICES, MAX_STOP_TOKEN_IDS, MAX_TOKEN_IDS, Word, capped
from prefixcache.server.errors import ApiError, Strict

ONE_VALUE = {  # accepted at the one value that needs nothing we lack
    "priority": (0, "no priority scheduling"), "use_beam_search": (False, "no beam search"),
    "length_penalty": (1.0, "it weighs beam search's beams"), "watermarking": (False, "no watermarking"),
    "spaces_between_special_tokens": (True, "special tokens' text is left out of the output, or shown as decoded"),
    "return_hidden_states": (False, "no hidden states in responses"),
}
NOT_STREAMED = ("return_token_ids", "prompt_logprobs")


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: one of its guides (grammar and structural_tag are refused: unknown fields)."""
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: capped(Word, MAX_CHOICES, 1) | None = None
    json_object: bool | None = None


class Extensions(Strict):
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: capped(int, MAX_STOP_TOKEN_IDS) | None = None
    ignore_eos: bool | None = None
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    allowed_token_ids: capped(int, MAX_TOKEN_IDS, 1) | None = None
    bad_words: capped(Word, MAX_BAD_WORDS) | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    add_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None  # not streamed
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # not streamed
    request_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\w.:-]+$")
    session_id: str | None = None  # informational
    priority: int | None = None  # the ONE_VALUE fields
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    watermarking: bool | None = None
    spaces_between_special_tokens: bool | None = None
    guided_regex: str | None = None
    guided_choice: capped(Word, MAX_CHOICES, 1) | None = None
    guided_json: dict | str | None = None  # older vLLM's: a JSON schema
    structured_outputs: StructuredOutputs | None = None
    # SGLang's, which its gateway (and vllm-router, its fork) adds to every request at these defaults
    no_stop_trim: bool | None = None  # the stop string stays in the output: include_stop_str_in_output
    return_hidden_states: bool | None = None  # a ONE_VALUE field

    @field_validator(*ONE_VALUE)
    @classmethod
    def the_one_value(cls, v, info: ValidationInfo):
        value, why = ONE_VALUE[info.field_name]
        if v is not None and v != value:
            raise ValueError(f"only {json.dumps(value)} is supported: {why}")
        return v

    def refuse_unstreamable(self) -> None:
        """The fields whose output is not streamed are a 400 with stream."""
        stream = getattr(self, "stream", False)
        for name in NOT_STREAMED:
            if getattr(self, name) not in (None, False) and stream:
                raise ApiError(400, f"{name}: not with stream", param=name)

    def extension_params(self, tokenizer) -> dict:
        """The SamplingParams these fields set."""
        return dict(repetition_penalty=self.repetition_penalty or 1.0, min_tokens=self.min_tokens or 0,
                    stop_token_ids=self.stop_token_ids or [], ignore_eos=bool(self.ignore_eos),
                    top_k=max(self.top_k or 0, 0), min_p=self.min_p or 0.0, allowed_token_ids=self.allowed_token_ids,
                    bad_words=self.bad_word_ids(tokenizer), skip_special_tokens=self.skip_special_tokens is not False,
                    include_stop_str_in_output=bool(self.include_stop_str_in_output or self.no_stop_trim))

    def extension_guides(self) -> dict:
        """The guides these fields give, by field name (at most one is allowed; the caller checks)."""
        so = self.structured_outputs
        nested = [("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                  ("json_object", so.json_object or None)] if so else []
        return {name: g for name, g in (("guided_regex", self.guided_regex), ("guided_choice", self.guided_choice),
                                        ("guided_json", self.guided_json),
                                        *((f"structured_outputs.{k}", v) for k, v in nested)) if g is not None}

    def bad_word_ids(self, tokenizer) -> list[list[int]]:
        """vLLM's reading of bad_words: each word's tokens, and those of its space-prefixed form where that is another
        word of as many tokens."""
        out = []
        for word in self.bad_words or []:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ApiError(400, "bad_words: every entry must tokenize to at least one token", param="bad_words")
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out += [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])
        return out
