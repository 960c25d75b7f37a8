"""Load OpenAI/Anthropic request JSON or JSONL and plain-text templates into one shape: the ordered text fields that
prefixcache/prompt.py reads from a request (a template is one system field).

Location convention: `line:col` are 1-based and point at the offending character in the file as written. Inside a
JSON string the column counts raw characters, so an escape such as `\\n` counts as two. When the text cannot be
found verbatim (e.g. it sits inside a re-serialized tool), the location falls back to the start of the request,
which for JSONL is column 1 of the request's line."""
import json
import os
import re
from dataclasses import dataclass, field

from prefixcache.prompt import Field, fields

PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}|\{(\w+)\}")


@dataclass
class Request:
    path: str
    file_text: str
    start: int  # char range of this request in file_text
    end: int
    fields: list[Field]
    tools: list[dict] = field(default_factory=list)  # as sent
    template: bool = False  # a plain-text template: placeholders are the per-request slots

    @property
    def line(self) -> int:
        return self.file_text.count("\n", 0, self.start) + 1

    @property
    def start_location(self) -> tuple[int, int]:
        return self._line_col(self.start)

    @property
    def placeholders(self) -> list[re.Match]:
        return list(PLACEHOLDER.finditer(self.fields[0].text)) if self.template else []

    def location(self, f: Field, offset: int, value: str = "") -> tuple[int, int]:
        """(line, col) in the file of character `offset` of field `f` (see the module doc)."""
        return self._line_col(self._offset(f, offset, value))

    def breakpoint_location(self, f: Field) -> tuple[int, int]:
        """The `cache_control` key that follows field `f` in the file."""
        anchor = self._offset(f, len(f.text))
        pos = self.file_text.find('"cache_control"', anchor, self.end)
        return self._line_col(pos if pos >= 0 else anchor)

    def _offset(self, f: Field, offset: int, value: str = "") -> int:
        if self.template:
            return offset
        region = self.file_text[self.start:self.end]
        for ascii_only in (False, True):
            enc = json.dumps(f.text, ensure_ascii=ascii_only)[1:-1]
            i = region.find(enc) if enc else -1
            if i >= 0:
                return self.start + i + len(json.dumps(f.text[:offset], ensure_ascii=ascii_only)[1:-1])
        i = region.find(json.dumps(value)[1:-1]) if value else -1
        return self.start + max(i, 0)

    def _line_col(self, pos: int) -> tuple[int, int]:
        return self.file_text.count("\n", 0, pos) + 1, pos - (self.file_text.rfind("\n", 0, pos) + 1) + 1


def load(path: str) -> list[Request]:
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        out, pos = [], 0
        for line in text.split("\n"):
            if line.strip():
                out.append(parse(json.loads(line), path, text, pos, pos + len(line)))
            pos += len(line) + 1
        return out
    if ext == ".json":
        obj = json.loads(text)
        return [parse(o, path, text, 0, len(text)) for o in (obj if isinstance(obj, list) else [obj])]
    return [Request(path, text, 0, len(text), [Field("template", None, "system", text)], template=True)]


def parse(obj: dict, path: str, file_text: str, start: int, end: int) -> Request:
    """One logged request: a bare OpenAI/Anthropic body, or an entry wrapping it under "request" or "body"."""
    body = obj.get("request") or obj.get("body") or obj
    if not isinstance(body.get("messages"), list):
        raise ValueError(f"{path}: a request needs a `messages` list")
    return Request(path, file_text, start, end, fields(body), body.get("tools") or [])
