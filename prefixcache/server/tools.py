"""Tool calls for both APIs: `tool_choice` becomes the structured-output guide that forces a valid call, and a
reply is read back as calls when it is written the way the renderer (prefixcache/prompt.py) writes them.

With `auto` the model may answer in text or call; a streamed reply is held back only while it may still become a
call (it starts like one), and is released as text as soon as it cannot.
"""
import json
from dataclasses import dataclass

from prefixcache.engine.guide import Guide
from prefixcache.prompt import call_schema, tool_calls

CALL_START = '{"tool_use"'


@dataclass
class ToolUse:
    tools: dict[str, dict]  # name -> parameters' JSON schema
    force: list[str] | None = None  # a call to one of these is required; None: the model decides

    def guide(self) -> Guide | None:
        if self.force is None:
            return None
        return Guide("json_schema", json.dumps(call_schema({n: self.tools[n] for n in self.force})))

    def calls(self, text: str) -> list[tuple[str, object]] | None:
        return tool_calls(text, set(self.tools))


class Holdback:
    """One streamed sample's text, held while it may still be a tool call."""

    def __init__(self):
        self.held = ""
        self.released = False

    def feed(self, delta: str) -> str:
        """The text that can be sent now."""
        if self.released:
            return delta
        self.held += delta
        start = self.held.lstrip()
        if start and not (start.startswith(CALL_START) or CALL_START.startswith(start)):
            self.released, text, self.held = True, self.held, ""
            return text
        return ""
