"""Every request field of both APIs in one table: supported, accepted but ignored (and why), or refused.

The request models (openai.py, anthropic.py) declare exactly the supported and ignored fields and refuse any
other with a 400 naming it; tests hold the models, this table and the README's copy of it (`markdown()`) to
each other. Refused rows list the fields clients commonly send, with the reason, and an example value.
"""
from dataclasses import dataclass
from typing import Any

SUPPORTED, IGNORED, REFUSED = "supported", "accepted, ignored", "refused (400)"


@dataclass(frozen=True)
class Row:
    api: str  # "openai" (both endpoints unless the note says) or "anthropic"
    field: str
    status: str
    note: str = ""
    example: Any = None  # refused rows: a value a client would send


def _rows(api: str, status: str, notes: dict[str, str]) -> list[Row]:
    return [Row(api, f, status, note) for f, note in notes.items()]


def _refused(api: str, examples: dict[str, tuple[Any, str]]) -> list[Row]:
    return [Row(api, f, REFUSED, note, example) for f, (example, note) in examples.items()]


TABLE: list[Row] = [
    *_rows("openai", SUPPORTED, {
        "model": "the served model's name or `default`",
        "messages": "chat: system, developer, user, assistant (with `tool_calls`), tool",
        "tools": "chat: rendered into the system prompt, as the chat template does",
        "prompt": "completions: one string or token-id list",
        "max_tokens": "", "max_completion_tokens": "", "temperature": "0 to 2", "top_p": "", "seed": "",
        "stop": "at most 4", "n": "up to `max_num_seqs`: the samples share one prefill; sample i has seed + i",
        "stream": "", "stream_options": "`include_usage`",
        "prompt_cache_key": "narrows the cache scope", "cache_salt": "narrows the cache scope",
        "prompt_cache_retention": "`in_memory` or `24h`: entries live until evicted either way",
        "response_format": "`text`, `json_object`, `json_schema`: the output follows it (xgrammar)",
        "guided_regex": "vLLM extension: the output matches the pattern",
        "guided_choice": "vLLM extension: the output is one of the strings",
        "guided_json": "older vLLM extension: the output follows the JSON schema (an object or its text)",
        "structured_outputs": "vLLM extension: one of `json` (a schema), `regex`, `choice`, `json_object`; its "
                              "`grammar` and `structural_tag` are refused",
        "return_token_ids": "vLLM extension: the prompt's and each choice's token ids (not streamed)",
        "prompt_logprobs": "vLLM extension: 0 to 20, each prompt token's logprob and rank and the most likely tokens "
                           "(the prompt is then recomputed; not streamed)",
        "best_of": "completions: generated, and the n with the highest cumulative logprob returned; not streamed",
        "logprobs": "chat: true or false; completions: 0 to 5. Of the raw logits (before penalties, temperature)",
        "top_logprobs": "chat: 0 to 20, with `logprobs`",
        "echo": "completions: the prompt first; with `logprobs`, its logprobs (the prompt is then recomputed, "
                "`cached_tokens` 0). Chat (vLLM's): a final assistant message's text starts the reply",
        "logit_bias": "token ids of the vocabulary: -100 to 100",
        "presence_penalty": "-2 to 2, over the output", "frequency_penalty": "-2 to 2, over the output",
        "repetition_penalty": "vLLM extension: > 0, over the prompt and the output",
        "min_tokens": "vLLM extension: no EOS, stop token or stop string before it; not with a guide (400)",
        "stop_token_ids": "vLLM extension: finish on these tokens",
        "tool_choice": "chat: `none`, `auto` (a reply written as calls is returned as `tool_calls`), `required` or a "
                       "named function (a valid call is forced with the parameters' schema)",
        "parallel_tool_calls": "chat: a forced call is one call; with `auto`, one call per reply line",
        "speculative": "extension: `false` opts the request out of speculative decoding (when the server has it on)",
        "ignore_eos": "vLLM extension: generate past EOS, up to max_tokens",
        "top_k": "vLLM extension: -1 or 0 off", "min_p": "vLLM extension: 0 to 1, after temperature",
        "allowed_token_ids": "vLLM extension: only these tokens may be generated",
        "bad_words": "vLLM extension: the output never completes one of these words (each as it tokenizes, with "
                     "and without a leading space)",
        "skip_special_tokens": "vLLM extension: default true; false shows special tokens' text",
        "include_stop_str_in_output": "vLLM extension: the stop string (or stop token's text) that ended the output "
                                      "stays in it",
        "add_special_tokens": "vLLM extension: the tokenizer's special tokens around the prompt (completions: "
                              "default true; chat: default false)",
        "return_tokens_as_token_ids": "vLLM extension: logprobs show each token as `token_id:N`",
        "request_id": "vLLM extension: the response's id is `chatcmpl-` or `cmpl-` and it (letters, digits, `_.:-`)",
        "add_generation_prompt": "vLLM extension, chat: default true",
        "continue_final_message": "vLLM extension, chat: the last message is left open and the reply continues it",
        "chat_template_kwargs": "vLLM extension, chat: variables for the chat template",
        "truncate_prompt_tokens": "vLLM extension, completions: keep this many prompt tokens (-1: the context "
                                  "window)",
        "truncation_side": "vLLM extension, completions: `left` (default) keeps the end, `right` the start",
        "no_stop_trim": "SGLang extension (its gateway and vllm-router send it): as `include_stop_str_in_output`",
    }),
    *_rows("openai", IGNORED, {
        "user": "informational", "safety_identifier": "informational", "metadata": "informational",
        "service_tier": "one tier here", "store": "nothing is stored", "session_id": "vLLM extension: informational",
        "include_reasoning": "vLLM extension: not a reasoning model",
        "priority": "vLLM extension: 0 only, no priority scheduling (else 400)",
        "use_beam_search": "vLLM extension: false only, no beam search (else 400)",
        "length_penalty": "vLLM extension: 1 only, it weighs beams (else 400)",
        "watermarking": "vLLM extension: false only (else 400)",
        "spaces_between_special_tokens": "vLLM extension: true only (else 400)",
        "return_hidden_states": "SGLang extension: false only (else 400)",
        "separate_reasoning": "SGLang extension, chat: not a reasoning model",
        "stream_reasoning": "SGLang extension, chat: not a reasoning model",
    }),
    *_refused("openai", {
        "suffix": ("}", "completions: no fill-in-the-middle"), "functions": ([], "deprecated: use tools"),
        "function_call": ("auto", "deprecated: use tool_choice"), "audio": ({}, "text only"),
        "modalities": (["audio"], "text only"), "prediction": ({}, "no predicted outputs"),
        "reasoning_effort": ("low", "not a reasoning model"), "web_search_options": ({}, "no tools of our own"),
        # vLLM's other extensions (its OpenAI protocol, 0.32)
        "return_token_offsets": (True, "vLLM extension: not implemented"),
        "return_prompt_text": (True, "vLLM extension: not implemented"),
        "logprob_token_ids": ([5], "vLLM extension: not implemented"),
        "guided_grammar": ("root ::= \"a\"", "older vLLM extension: no grammars beyond JSON, regex and choice"),
        "documents": ([{"text": "x"}], "vLLM extension: the chat template takes no documents"),
        "chat_template": ("{{ messages }}", "vLLM extension: the model's own chat template only"),
        "mm_processor_kwargs": ({}, "text only"), "media_io_kwargs": ({}, "text only"), "mm_payload": ({}, "text only"),
        "return_mm_kwargs": (True, "text only"), "prompt_embeds": ("", "token ids or text only"),
        "kv_transfer_params": ({}, "vLLM extension: no disaggregated prefill"),
        "ec_transfer_params": ({}, "vLLM extension: no disaggregated encoder"),
        "vllm_xargs": ({}, "vLLM extension: no custom logits processors"),
        "repetition_detection": ({}, "vLLM extension: not implemented"),
        "thinking_token_budget": (256, "vLLM extension: not a reasoning model"),
        "routed_experts_prompt_start": (0, "vLLM extension: not a mixture of experts"),
    }),
    *_rows("anthropic", SUPPORTED, {
        "model": "the served model's name or `default`", "max_tokens": "",
        "messages": "text, `tool_use` and `tool_result` blocks (`is_error` false only)",
        "system": "a string or text blocks", "tools": "rendered into the system prompt",
        "temperature": "0 to 1", "top_p": "", "top_k": "", "stop_sequences": "", "stream": "",
        "cache_control": "on tools, system and message blocks, or top level: `5m` or `1h`, at most 4",
        "cache_salt": "extension: narrows the cache scope", "prompt_cache_key": "extension: narrows the cache scope",
        "speculative": "extension: `false` opts the request out of speculative decoding (when the server has it on)",
        "tool_choice": "`none`, `auto` (a reply written as calls is returned as `tool_use` blocks), `any` or a named "
                       "`tool` (a valid call is forced with its input schema)",
    }),
    *_rows("anthropic", IGNORED, {"metadata": "informational", "service_tier": "one tier here"}),
    *_refused("anthropic", {
        "thinking": ({"type": "enabled", "budget_tokens": 1024}, "not a reasoning model"),
        "container": ("c", "no code execution"), "mcp_servers": ([], "no MCP connector"),
    }),
]


def markdown() -> str:
    """The table as the README shows it."""
    lines = ["| API | field | status | note |", "|---|---|---|---|"]
    lines += [f"| {r.api} | `{r.field}` | {r.status} | {r.note} |" for r in TABLE]
    return "\n".join(lines)
