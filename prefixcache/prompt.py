"""The one renderer: an OpenAI or Anthropic chat request -> token ids, and a map from each token back to the request.

Both server routes, LLM.chat, the linter and `prefixcache diff`, and the bench's JSONL loader render through here,
so the ids the linter costs are the ids the server caches. `fields` reads a request body of either API (their shapes
do not clash) into the text fields it contributes, in prefix order tools -> system -> messages. `render` joins them
into chat messages, applies the model's chat template and tokenizes the text itself, with offsets (rather than
apply_chat_template(tokenize=True)), so token ids and character positions agree by construction.

How a request becomes text:
- tools have no slot in the SmolLM2 template: they open the first system message as "# Tools\\n" and one JSON text
  each (sorted keys, without cache_control), a newline apart; the system text follows after a blank line;
- the `developer` role is `system`; the content blocks (text parts) of one message are joined by newlines;
- a tool call (OpenAI `tool_calls`, Anthropic `tool_use`) is {"tool_use": name, "input": input}; a tool result is
  its text; any other block (an image: only the linter lets one through) is the JSON it was sent as;
- a `cache_control` puts a breakpoint after its tool or block; a top-level one after the last block.
"""
import bisect
import json
from dataclasses import dataclass

TOOLS_HEADER = "# Tools\n"
BLOCK_SEP = "\n"  # between tools, and between the content blocks of one message
AFTER_TOOLS = "\n\n"  # between the last tool and the system text
ROLES = {"developer": "system"}


@dataclass
class Field:
    """One piece of text that a request contributes to its prompt."""

    name: str  # where it is in the request: "tools[0]", "system", "system[1].text", "messages[2].content[1].text", ...
    message_index: int | None  # index into the request's `messages`; None for tools and a top-level system
    role: str  # the chat role it is rendered under
    text: str
    breakpoint: str | None = None  # the TTL ("5m" | "1h") of a cache_control that ends a cached prefix after it

    @property
    def is_tool(self) -> bool:
        return self.name.startswith("tools[")


@dataclass
class Span:
    field: Field
    start: int  # character range of the field's text in the rendered prompt
    end: int


@dataclass
class Prompt:
    text: str
    token_ids: list[int]
    offsets: list[tuple[int, int]]  # character range of each token in `text`
    spans: list[Span]  # one per field, in prefix order
    message_spans: list[tuple[int, int]]  # character range of each chat message's content

    @property
    def breakpoints(self) -> list[tuple[int, str]]:
        """(token position where a marked field ends, its TTL), in prefix order."""
        return [(self.token_at(s.end), s.field.breakpoint) for s in self.spans if s.field.breakpoint]

    def token_at(self, char: int) -> int:
        """Index of the token that contains (or first follows) character `char`."""
        return bisect.bisect_right([end for _, end in self.offsets], char)

    def span_at(self, char: int) -> Span | None:
        return next((s for s in self.spans if s.start <= char < s.end or s.start == char == s.end), None)

    def where(self, token: int) -> str:
        """Where token `token` sits, for the miss explainer: 'message=k; offset=c' (k counts chat messages, the tools
        merged into the system one), 'at=template' for the chat template's own tokens, or 'at=end'."""
        if token >= len(self.offsets):
            return "at=end"
        char = self.offsets[token][0]
        for k, (start, end) in enumerate(self.message_spans):
            if start <= char < end:
                return f"message={k}; offset={char - start}"
        return "at=template"


def fields(body: dict) -> list[Field]:
    """The text fields of a chat request body, OpenAI's or Anthropic's, in prefix order."""
    out = [Field(f"tools[{i}]", None, "system", _json(_without_cache_control(t), sort_keys=True), _ttl(t))
           for i, t in enumerate(body.get("tools") or [])]
    system = body.get("system")  # Anthropic's: a string or text blocks
    if isinstance(system, str) and system:
        out.append(Field("system", None, "system", system))
    out += [_block(f"system[{j}]", None, "system", b) for j, b in enumerate(system if isinstance(system, list) else [])]
    for i, m in enumerate(body["messages"]):
        out += _message(i, m)
    if body.get("cache_control") and out[-1].breakpoint is None:  # Anthropic's automatic caching
        out[-1].breakpoint = _ttl(body)
    return out


def render(tokenizer, fields: list[Field], generation_prompt: bool = True, continue_final: bool = False,
           add_special_tokens: bool = False, template_kwargs: dict | None = None) -> Prompt:
    """The prompt's token ids, and where each field and each chat message sits in its text. continue_final leaves
    the last message open (the reply continues it); template_kwargs go to the chat template."""
    messages = chat_messages(fields)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                         continue_final_message=continue_final, **(template_kwargs or {}))
    spans, message_spans, cursor = [], [], 0
    for fs in _chat(fields):
        content, starts = _content(fs)
        base = text.find(content, cursor)
        assert base >= 0, "the chat template must embed message content verbatim"
        message_spans.append((base, base + len(content)))
        spans += [Span(f, base + s, base + s + len(f.text)) for f, s in zip(fs, starts)]
        cursor = base + len(content)
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return Prompt(text, list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]], spans, message_spans)


def chat_messages(fields: list[Field]) -> list[dict]:
    """The plain chat messages (role, content string) that `render` gives the chat template."""
    return [{"role": fs[0].role, "content": _content(fs)[0]} for fs in _chat(fields)]


def encode_system(tokenizer, text: str) -> list[int]:
    """A system prompt's tokens as they start a chat request (for declared shared prefixes)."""
    return render(tokenizer, [Field("system", None, "system", text)], generation_prompt=False).token_ids


def tool_calls(text: str, names: set[str]) -> list[tuple[str, object]] | None:
    """The calls in a model's reply written as this renderer writes them (one {"tool_use": name, "input": ...}
    per line), to tools in `names`; None if the reply is anything else."""
    calls = []
    for line in text.strip().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        if not (isinstance(obj, dict) and set(obj) == {"tool_use", "input"} and obj["tool_use"] in names):
            return None
        calls.append((obj["tool_use"], obj["input"]))
    return calls or None


def call_schema(tools: dict[str, dict]) -> dict:
    """A JSON schema (tool name -> its parameters' schema) whose instances are one call to one of the tools, as
    this renderer writes it: structured output can then force a valid call."""
    options = [{"type": "object", "additionalProperties": False, "required": ["tool_use", "input"],
                "properties": {"tool_use": {"const": name}, "input": params or {"type": "object"}}}
               for name, params in tools.items()]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _message(i: int, m: dict) -> list[Field]:
    role, content, name = ROLES.get(m["role"], m["role"]), m.get("content"), f"messages[{i}].content"
    if isinstance(content, str):
        out = [Field(name, i, role, content)]
    else:
        out = [_block(f"{name}[{j}]", i, role, b) for j, b in enumerate(content or [])]
    out += [Field(f"messages[{i}].tool_calls[{k}]", i, role, _openai_call(c["function"]))
            for k, c in enumerate(m.get("tool_calls") or [])]
    return out or [Field(name, i, role, "")]


def _block(name: str, i: int | None, role: str, b: dict) -> Field:
    suffix = ".text" if b.get("type") == "text" else ""  # named down to the text, which the linter finds in the file
    return Field(name + suffix, i, role, _block_text(b), _ttl(b))


def _block_text(b: dict) -> str:
    kind = b.get("type")
    if kind == "text":
        return b["text"]
    if kind == "tool_use":
        return _tool_call(b["name"], b.get("input"))
    if kind == "tool_result":
        content = b.get("content")
        return content if isinstance(content, str) else BLOCK_SEP.join(map(_block_text, content or []))
    return _json(_without_cache_control(b))


def _openai_call(function: dict) -> str:
    """OpenAI sends a call's input as JSON text: rendered as the object, as Anthropic sends it, when it parses."""
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:  # a model may write anything there
        arguments = function["arguments"]
    return _tool_call(function["name"], arguments)


def _tool_call(name: str, arguments) -> str:
    return _json({"tool_use": name, "input": arguments})


def _chat(fields: list[Field]) -> list[list[Field]]:
    """Fields grouped into chat messages: one per request message, and the tools join the system message after them."""
    chat: list[list[Field]] = []
    for f in fields:
        prev = chat[-1][-1] if chat else None
        if prev and prev.role == f.role and (prev.message_index == f.message_index or prev.is_tool):
            chat[-1].append(f)
        else:
            chat.append([f])
    return chat


def _content(fields: list[Field]) -> tuple[str, list[int]]:
    """One chat message's content, and where each of its fields starts in it."""
    text, starts = "", []
    for prev, f in zip([None, *fields], fields):
        text += _separator(prev, f)
        starts.append(len(text))
        text += f.text
    return text, starts


def _separator(prev: Field | None, f: Field) -> str:
    if f.is_tool:
        return BLOCK_SEP if prev else TOOLS_HEADER
    if prev is None:
        return ""
    return AFTER_TOOLS if prev.is_tool else BLOCK_SEP


def _ttl(obj: dict) -> str | None:
    cc = obj.get("cache_control")
    return cc.get("ttl", "5m") if cc else None


def _without_cache_control(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k != "cache_control"}


def _json(obj, sort_keys: bool = False) -> str:
    return json.dumps(obj, sort_keys=sort_keys, ensure_ascii=False)
