"""Rule codes and the detectors for volatile values and whitespace in prompt text.

Detectors favour precision: a number alone is never volatile (versions, prices, counts, years in prose, section
numbers); it takes a shape that only changes per request (ISO timestamps, UUIDs, long ids, epoch seconds) or a cue
word next to it ("Current date:", "request_id=", "seed:", "user:")."""
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    code: str
    severity: str  # "error" | "warning"
    title: str
    fix: str


RULES = {r.code: r for r in [
    Rule("PC101", "error", "timestamp or date",
         "move it after the last static block, or round it to the day at the end of the prompt"),
    Rule("PC102", "error", "request, trace or session id", "send ids as metadata or headers, not in the prompt"),
    Rule("PC103", "error", "email or user name", "move per-user data into the last user turn"),
    Rule("PC104", "error", "random number or nonce", "drop it, or move it after the static prefix"),
    Rule("PC105", "error", "text that varies across requests of one template", "make it static or move it to the end"),
    Rule("PC201", "error", "per-request placeholder before static material",
         "move the placeholder after the static text"),
    Rule("PC301", "warning", "tools not in canonical order", "sort tools by name before sending"),
    Rule("PC302", "warning", "JSON schema properties not in canonical order",
         "serialize with sorted keys (json.dumps(..., sort_keys=True))"),
    Rule("PC401", "error", "same object serialized differently across requests",
         "serialize with sorted keys and fixed separators"),
    Rule("PC501", "warning", "trailing whitespace", "strip trailing whitespace from every line"),
    Rule("PC502", "warning", "mixed newlines or indentation", "normalize to \\n and one indentation style"),
    Rule("PC503", "error", "whitespace drift across requests", "normalize whitespace before sending"),
    Rule("PC601", "error", "breakpoint after volatile content",
         "place the breakpoint before the volatile value, or move the value after it"),
    Rule("PC701", "warning", "prefix shorter than the minimum cacheable length",
         "grow the static prefix or accept no caching"),
]}


@dataclass
class Hit:
    code: str
    start: int
    end: int
    value: str


_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_DATE = (rf"(?:\d{{4}}-\d{{2}}-\d{{2}}|\d{{1,2}}/\d{{1,2}}/\d{{2,4}}|{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}"
         rf"|\d{{1,2}} {_MONTH},? \d{{4}}|(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,? {_MONTH} \d{{1,2}}(?:,? \d{{4}})?)")
_CUE_TIME = r"\b(?:today|now|current(?:ly)?|date|time|timestamp|as of|generated(?: at| on)?)\b"
_NOT_ROLE_MAILBOX = (r"(?!(?:support|help|info|contact|sales|noreply|no-reply|admin|team|hello|"
                     r"privacy|security|billing)@)")
_USER_CUE = r"\b(?:user(?:'s)?(?:[ _]?name)?|customer(?:[ _]?name)?|client[ _]?name|account[ _]holder)"

DETECTORS: list[tuple[str, re.Pattern]] = [(code, re.compile(p, flags)) for code, p, flags in [
    ("PC101", r"\b(?P<v>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)", 0),
    ("PC101", rf"{_CUE_TIME}[^\n.]{{0,20}}?(?P<v>{_DATE}(?:,? \d{{1,2}}:\d{{2}}(?::\d{{2}})?)?)", re.I),
    ("PC101", rf"{_CUE_TIME}[^\n.\d]{{0,12}}(?P<v>\d{{1,2}}:\d{{2}}(?::\d{{2}})?(?: ?[AP]M)?(?: UTC| GMT)?)", re.I),
    ("PC101", r"(?<![\d:])(?P<v>\d{1,2}:\d{2}:\d{2})(?![\d:])", 0),
    ("PC101", r"(?<![\w.,$])(?P<v>1[5-9]\d{8}(?:\d{3})?)(?![\w.,])", 0),
    ("PC102", r"\b(?P<v>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b", re.I),
    ("PC102", r"\b(?:request|trace|span|session|correlation|conversation|transaction)[ _-]?id\b"
              r"\W{0,3}(?P<v>[\w-]{4,})", re.I),
    ("PC102", r"\b(?P<v>(?:req|trace|span|sess|session|corr|msg|chatcmpl|run|conv|call)[-_]"
              r"(?=[A-Za-z]*\d)[A-Za-z0-9]{6,})\b", 0),
    ("PC102", r"(?<![\w-])(?P<v>(?=[a-f]*\d)(?=\d*[a-f])[0-9a-f]{16,})(?![\w-])", re.I),
    ("PC103", rf"(?<![\w.+-]){_NOT_ROLE_MAILBOX}(?P<v>[\w.+-]+@[\w-]+(?:\.[\w-]+)+)", re.I),
    ("PC103", rf"{_USER_CUE}\s*(?:[:=]|\bis\b)\s*(?P<v>(?-i:[A-Z][\w.'-]*(?: [A-Z][\w'-]*)?)|@\w+)", re.I),
    ("PC103", r"\b(?i:you are (?:talking|speaking|chatting) (?:to|with)|(?:hello|hi|dear),?)"
              r"\s+(?P<v>[A-Z][a-z]+(?: [A-Z][a-z]+)?)\b", 0),
    ("PC104", r"\b(?:nonce|seed|salt|random(?: number| value| id)?|cache[-_ ]?buster)\b"
              r"\W{0,3}(?P<v>(?=[\w-]*\d)[\w-]+)", re.I),
    ("PC104", r"(?<![\w.,$-])(?P<v>\d{8,})(?![\w.,-])", 0),
]]


def volatile(text: str) -> list[Hit]:
    """Volatile values in `text`, by position; an overlap keeps the earliest (and, tied, the first detector)."""
    hits = sorted((Hit(code, m.start("v"), m.end("v"), m.group("v"))
                   for code, p in DETECTORS for m in p.finditer(text)),
                  key=lambda h: h.start)
    out: list[Hit] = []
    for h in hits:
        if not out or h.start >= out[-1].end:
            out.append(h)
    return out


def whitespace(text: str) -> list[Hit]:
    hits = [Hit("PC501", m.start(), m.end(), m.group()) for m in re.finditer(r"[ \t]+(?=\r?\n|$)", text)]
    crlf = [m.start() for m in re.finditer(r"\r\n", text)]
    if crlf and re.search(r"(?<!\r)\n", text):
        hits.append(Hit("PC502", crlf[0], crlf[0] + 2, "\\r\\n"))
    tab, space = re.search(r"^\t+\S", text, re.M), re.search(r"^ {2,}\S", text, re.M)
    if tab and space:
        later = max(tab, space, key=lambda m: m.start())
        hits.append(Hit("PC502", later.start(), later.end() - 1, later.group()[:-1]))
    return sorted(hits, key=lambda h: h.start)
