"""The most work one request may ask for. Each cap is checked while the body is parsed (every string's is Strict's,
server/errors.py), or for `n` and `best_of`, which depend on the engine, first thing in the handler; a request over
one is a 400 naming the field and the cap before anything is tokenized, rendered or built for it. The README's table
of caps is `markdown()`.

What each bounds: the engine walks the token lists and bad words of every sample at every step, the event loop
tokenizes each bad word and renders every message and tool, and a sample costs a slot and a structure per `n`.
"""
from typing import Annotated, Any

from pydantic import Field

MAX_STRING = 1 << 19  # characters of any one string (a prompt, a message's text, a tool's description)
MAX_WORD = 256  # characters of a stop string, a bad word, a guided choice
MAX_STOP = 4  # OpenAI's stop strings (as OpenAI allows)
MAX_STOP_SEQUENCES = 16  # Anthropic's stop_sequences
MAX_BAD_WORDS = 64
MAX_TOKEN_IDS = 1024  # allowed_token_ids
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_CHOICES = 256  # guided_choice, structured_outputs.choice
MAX_MESSAGES = 2048
MAX_PARTS = 256  # content parts or blocks of one message, the system prompt's blocks, a message's tool calls
MAX_TOOLS = 128  # as OpenAI allows
MAX_METADATA = 16  # metadata pairs, as OpenAI allows; also chat_template_kwargs' variables
MAX_LOGPROB_ENTRIES = 1 << 19  # a token's logprob or an alternative's, in one response: about 30 MB of JSON (n = 16
# and prompt_logprobs = 20 on an 8k-token prompt asked for 2.7 million, 160 MB, built while the event loop waited)

Word = Annotated[str, Field(max_length=MAX_WORD)]


def capped(item: Any, most: int, least: int = 0) -> Any:
    """A list of `item`s of at most `most` entries (and at least `least`)."""
    return Annotated[list[item], Field(min_length=least, max_length=most)]


def markdown(max_num_seqs: int, max_body_bytes: int) -> str:
    """The caps as the README states them."""
    rows = [("`n`, `best_of`", f"{max_num_seqs} (`max_num_seqs`)"),
            ("any one string", f"{MAX_STRING:,} characters"),
            ("a stop string, a bad word, a guided choice", f"{MAX_WORD} characters"),
            ("`stop` (OpenAI)", MAX_STOP), ("`stop_sequences` (Anthropic)", MAX_STOP_SEQUENCES),
            ("`bad_words`", MAX_BAD_WORDS), ("`allowed_token_ids`", MAX_TOKEN_IDS),
            ("`stop_token_ids`", MAX_STOP_TOKEN_IDS), ("`logit_bias` entries", MAX_LOGIT_BIAS),
            ("`guided_choice`, `structured_outputs.choice`", MAX_CHOICES), ("`messages`", MAX_MESSAGES),
            ("content parts or blocks of a message, system blocks, tool calls of a message", MAX_PARTS),
            ("`tools`", MAX_TOOLS), ("`metadata` pairs, `chat_template_kwargs` variables", MAX_METADATA),
            ("logprob entries of a response (`logprobs`, `prompt_logprobs`, by `n` and `max_tokens`)",
             f"{MAX_LOGPROB_ENTRIES:,}"),
            ("the request body", f"{max_body_bytes:,} bytes (`--max-body-bytes`), else 413")]
    return "\n".join(["| what | at most |", "|---|---|", *(f"| {what} | {cap} |" for what, cap in rows)])
