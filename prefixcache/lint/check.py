"""Lint one rendered request or template: each finding located in the file, with the prefix tokens it costs."""
from dataclasses import dataclass

from prefixcache.lint.fingerprint import tool_name
from prefixcache.lint.render import Rendered
from prefixcache.lint.report import Finding
from prefixcache.lint.rules import RULES, volatile, whitespace
from prefixcache.options import default
from prefixcache.prompt import Span


@dataclass
class Options:
    min_tokens: int = default("min_cache_tokens")  # the server's minimum cacheable prefix
    prefix_tokens: int = 0  # if set, only the first N tokens count as the reusable part
    block_size: int = default("block_size")


class Checker:
    def __init__(self, r: Rendered, opt: Options):
        self.r, self.opt, self.findings = r, opt, []
        self.end = r.reusable_end(opt.prefix_tokens)
        self.reusable = r.token_at(self.end)  # tokens before the end of the reusable part

    def cost(self, char: int) -> int:
        """Reusable tokens lost when the prompt changes at `char`: everything from its block on."""
        bs = self.opt.block_size
        return max(0, self.reusable - self.r.token_at(char) // bs * bs)

    def add(self, code: str, span: Span, offset: int, value: str, what: str):
        """A finding at character `offset` of `span`'s field, costing the reusable tokens from there on."""
        char, rule = span.start + offset, RULES[code]
        verb = "costs" if rule.severity == "error" else "puts at risk"
        shown = f" {value!r}" if value else ""
        self.emit(code, self.r.request.location(span.field, offset, value), self.cost(char),
                  f"{rule.title}{shown} {what} (token {self.r.token_at(char)}): {verb} {self.cost(char)} prefix tokens")

    def emit(self, code: str, line_col: tuple[int, int], cost: int, message: str):
        rule = RULES[code]
        self.findings.append(Finding(self.r.request.path, *line_col, code, rule.severity, message, rule.fix, cost))

    def run(self) -> list[Finding]:
        volatile_chars = []
        for s in self.r.spans:
            if s.start >= self.end:
                break
            for h in volatile(s.field.text):
                if s.start + h.start < self.end:
                    volatile_chars.append((s.start + h.start, h.value))
                    self.add(h.code, s, h.start, h.value, f"in {s.field.name}")
            for h in whitespace(s.field.text):
                if s.start + h.start < self.end:
                    self.add(h.code, s, h.start, "", f"in {s.field.name}")
            if s.field.breakpoint and volatile_chars:
                self.breakpoint_after_volatile(s, *volatile_chars[0])
        self.placeholders()
        self.tools()
        if self.reusable < self.opt.min_tokens:
            self.emit("PC701", self.r.request.start_location, 0, f"{RULES['PC701'].title}: the reusable prefix is "
                      f"{self.reusable} tokens, the minimum {self.opt.min_tokens}; it will never be cached")
        return self.findings

    def breakpoint_after_volatile(self, s: Span, char: int, value: str):
        written = self.r.token_at(s.end)
        self.emit("PC601", self.r.request.breakpoint_location(s.field), written,
                  f"the breakpoint after {s.field.name} covers {value!r} (token {self.r.token_at(char)}): "
                  f"{written} tokens are written on every request and never read")

    def placeholders(self):
        """The first placeholder followed by at least one block of static text: that text can never be reused."""
        req, bs = self.r.request, self.opt.block_size
        if not req.template:
            return
        s, marks = self.r.spans[0], req.placeholders
        slots = [(s.start + m.start(), s.start + m.end()) for m in marks]
        for m in marks:
            static_after = sum(1 for a, b in self.r.offsets if s.start + m.end() <= a and b <= self.end
                               and not any(x < b and a < y for x, y in slots) and self.r.text[a:b].strip())
            if static_after >= bs:
                self.add("PC201", s, m.start(), m.group(), f"comes before {static_after} tokens of static text")
                return

    def tools(self):
        tools = self.r.request.tools
        spans = [s for s in self.r.spans if s.field.is_tool]
        names = [tool_name(t) for t in tools]
        wrong = next((i for i, (n, c) in enumerate(zip(names, sorted(names))) if n != c), None)
        if wrong is not None:
            self.add("PC301", spans[wrong], 0, names[wrong], f"at {spans[wrong].field.name}, expected {sorted(names)}")
        for t, s in zip(tools, spans):
            key = _unsorted_property(t)
            if key:
                self.add("PC302", s, 0, key, f"in {s.field.name} ({tool_name(t)})")


def _unsorted_property(obj) -> str | None:
    """The first schema property name out of sorted order, anywhere inside `obj`."""
    if isinstance(obj, dict):
        props = obj.get("properties")
        if isinstance(props, dict):
            keys = list(props)
            bad = next((k for k, c in zip(keys, sorted(keys)) if k != c), None)
            if bad:
                return bad
        return next((k for v in obj.values() if (k := _unsorted_property(v))), None)
    if isinstance(obj, list):
        return next((k for v in obj if (k := _unsorted_property(v))), None)
    return None
