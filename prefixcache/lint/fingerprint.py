"""Normalized requests (volatile values blanked, tools sorted by name, whitespace normalized) and the
template fingerprint: a stable hash of the static structure, so a template change is visible as a new version."""
import re
from dataclasses import replace

import xxhash

from prefixcache.lint.requests import PLACEHOLDER, Request
from prefixcache.lint.rules import volatile
from prefixcache.prompt import Field


def tool_name(tool: dict) -> str:
    return tool.get("name") or tool.get("function", {}).get("name", "")


def normalize_text(text: str) -> str:
    text = re.sub(r"[ \t]+", " ", re.sub(r"\s*\n\s*", "\n", text)).strip()
    for h in reversed(volatile(text)):
        text = f"{text[:h.start]}<{h.code}>{text[h.end:]}"
    return text


def normalize(req: Request) -> Request:
    """What the request would look like with every fix the linter suggests applied (the renderer already writes each
    tool's JSON with sorted keys)."""
    order = sorted(range(len(req.tools)), key=lambda i: tool_name(req.tools[i]))
    tools = [f for f in req.fields if f.is_tool]
    ttl = next((f.breakpoint for f in tools if f.breakpoint), None)
    tool_fields = [replace(tools[i], breakpoint=None) for i in order]
    if ttl:  # one breakpoint, after the last tool
        tool_fields[-1].breakpoint = ttl
    rest = [replace(f, text=normalize_text(f.text)) for f in req.fields if not f.is_tool]
    return replace(req, fields=tool_fields + rest, tools=[req.tools[i] for i in order])


def static_fields(req: Request) -> list[Field]:
    """The template part of a request: tools and system. A template file is all static, minus its placeholders."""
    if req.template:
        return [replace(req.fields[0], text=PLACEHOLDER.sub("{}", req.fields[0].text))]
    return [f for f in req.fields if f.message_index is None or f.role == "system"]


def fingerprint(req: Request, chat_template: str = "") -> str:
    """xxh64 of the normalized static fields and the chat template: equal for requests of one template version."""
    h = xxhash.xxh64(chat_template.encode())
    for f in static_fields(normalize(req)):
        h.update(b"\x1e" + f.text.encode())
    return h.hexdigest()


def group_key(req: Request, head_chars: int = 120) -> str:
    """Requests of one template share the normalized start of their static part, even across template versions."""
    head = "\x1e".join(f.text for f in static_fields(normalize(req)))[:head_chars]
    return xxhash.xxh64(head.encode()).hexdigest()
