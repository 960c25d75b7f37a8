"""The parts of an OpenAI request body: messages and their content, tools and tool choices, response formats."""
from typing import Literal

from pydantic import Field, model_validator

from prefixcache.server.caps import MAX_PARTS, capped
from prefixcache.server.errors import Strict


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str | None = None  # ignored: calls and results are rendered in order, without ids
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # a forced call always follows the parameters' schema


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | capped(TextPart, MAX_PARTS) | None = None
    name: str | None = None  # ignored: the chat template has no speaker names
    tool_calls: capped(ToolCall, MAX_PARTS) | None = None
    tool_call_id: str | None = None  # ignored, as ToolCall.id

    @model_validator(mode="after")
    def has_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content is required in a {self.role} message")
        return self


class JsonSchema(Strict):
    name: str
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: nothing to obfuscate on a local server
