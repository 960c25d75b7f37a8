"""Entry points behind `prefixcache lint` and `prefixcache diff`."""
from collections import Counter
from dataclasses import dataclass

from prefixcache.lint.check import Checker, Options
from prefixcache.lint.diff import Divergence, context, explain
from prefixcache.lint.fingerprint import fingerprint, normalize
from prefixcache.lint.log import analyze, classify
from prefixcache.lint.render import Rendered, load_tokenizer, render
from prefixcache.lint.report import Finding, Report
from prefixcache.lint.requests import load
from prefixcache.lint.rules import RULES
from prefixcache.options import default


def lint(paths: list[str], opt: Options, logs: list[str] = (), model: str = "") -> Report:
    """Lint every request and template in `paths`; files in `logs` also get per-template hit-rate reports."""
    tok, report = load_tokenizer(model), Report()
    for path in [*paths, *logs]:
        rendered = [render(req, tok) for req in load(path)]
        report.findings += _collapse([f for r in rendered for f in Checker(r, opt).run()])
        if len(rendered) > 1 or path in logs:
            normalized = [render(normalize(r.request), tok) for r in rendered]
            findings, groups = analyze(rendered, normalized, opt, tok.chat_template or "")
            report.findings += findings
            if path in logs:
                report.groups += groups
        else:
            report.fingerprints += [_fingerprint(r, tok) for r in rendered]
    return report


def _collapse(findings: list[Finding]) -> list[Finding]:
    """In a log, one finding per code and column (same template, same spot), with the number of requests."""
    first: dict[tuple, Finding] = {}
    counts = Counter((f.code, f.col) for f in findings)
    for f in findings:
        first.setdefault((f.code, f.col), f)
    for key, f in first.items():
        if counts[key] > 1:
            f.message += f"; seen in {counts[key]} requests"
    return list(first.values())


def _fingerprint(r: Rendered, tok) -> dict:
    static_end = r.reusable_end() if r.request.template else max(
        (s.end for s in r.spans if s.field.message_index is None or s.field.role == "system"), default=0)
    return {"file": r.request.path, "line": r.request.line, "static_tokens": r.token_at(static_end),
            "fingerprint": fingerprint(r.request, tok.chat_template or "")}


@dataclass
class DiffResult:
    a: Rendered
    b: Rendered
    divergence: Divergence

    def to_text(self) -> str:
        a, b, d = self.a, self.b, self.divergence
        lines = [f"A: {a.request.path} ({len(a.token_ids)} tokens)", f"B: {b.request.path} ({len(b.token_ids)} tokens)",
                 f"common prefix: {d.common_tokens} tokens; reusable for B: {d.reusable_tokens} tokens "
                 f"= {d.reusable_blocks} blocks"]
        if d.location is None:
            lines.append("no divergence: B is a prefix of A")
            return "\n".join(lines)
        for name, r, loc in (("A", a, d.a_location), ("B", b, d.location)):
            where = (f"message {loc.message_index} ({loc.role}) " if loc and loc.message_index is not None else "") + \
                (f"{loc.field} char {loc.char_offset}" if loc else "end of prompt")
            tok = r.token_ids[d.token_index] if d.token_index < len(r.token_ids) else None
            lines.append(f"{name}: first diverging token {d.token_index} ({tok}) at {where}")
            lines.append(f"   {context(r.text, d.char)}")
        code, detail = classify(a, b, d)
        lines.append(f"likely cause: {code} {RULES[code].title} {detail!r}" if code in RULES
                     else f"likely cause: {code}")
        return "\n".join(lines)


def diff(path_a: str, path_b: str, block_size: int = default("block_size"), model: str = "") -> DiffResult:
    """First divergence between the first request of each file."""
    tok = load_tokenizer(model)
    a, b = (render(load(p)[0], tok) for p in (path_a, path_b))
    return DiffResult(a, b, explain(a, b, block_size))
