"""Across a request log: group requests by template, simulate an exact block prefix cache in arrival order (as logged
and with the linter's fixes applied), and attribute the tokens lost to the cause at each divergence."""
import json
from collections import Counter
from dataclasses import dataclass, field

import xxhash

from prefixcache.lint.check import Options
from prefixcache.lint.diff import Divergence, explain
from prefixcache.lint.fingerprint import fingerprint, group_key, normalize_text, tool_name
from prefixcache.lint.render import Rendered
from prefixcache.lint.report import Finding
from prefixcache.lint.rules import RULES, volatile

NEW_TURN = "new user turn (expected)"
RECENT = 64  # prior requests of a group searched for the closest one


def simulate(prompts: list[list[int]], block_size: int) -> list[int]:
    """Cached tokens per prompt under exact full-block prefix reuse; the last prompt token is always recomputed."""
    seen: set[bytes] = set()
    hits = []
    for ids in prompts:
        h, keys = xxhash.xxh64(), []
        for j in range(len(ids) // block_size):
            h.update(b"".join(t.to_bytes(4, "little") for t in ids[j * block_size:(j + 1) * block_size]))
            keys.append(h.digest())
        matched = next((j for j, k in enumerate(keys) if k not in seen), len(keys))
        hits.append(min(matched, (len(ids) - 1) // block_size) * block_size)
        seen.update(keys)
    return hits


def classify(a: Rendered, b: Rendered, d: Divergence) -> tuple[str, str]:
    """(code or NEW_TURN, the differing value or detail) for the divergence of b from a."""
    loc = d.location
    if loc is None or loc.field == "<template>":
        return "PC105", "chat structure"
    fb = b.span_at(d.char).field
    if fb.is_tool:  # the renderer sorts each tool's keys: only the tools' order or their definitions can differ
        if sorted(_tool_texts(a)) == sorted(_tool_texts(b)):
            return "PC301", tool_name(b.request.tools[0])
        return "PC105", f"tool definitions ({fb.name})"
    hit = next((h for h in volatile(fb.text) if h.start <= loc.char_offset < h.end + 1), None)
    if hit:
        return hit.code, hit.value
    fa = next((f for f in (s.field for s in a.spans) if f.name == fb.name), None)
    if fa and normalize_text(fa.text) == normalize_text(fb.text):
        return "PC503", fb.text[max(0, loc.char_offset - 1):loc.char_offset + 2]
    if fa and _same_json(fa.text, fb.text):
        return "PC401", fb.name
    if fb.message_index is not None and fb.message_index == b.spans[-1].field.message_index:
        return NEW_TURN, ""
    return "PC105", fb.text[loc.char_offset:loc.char_offset + 30]


def _tool_texts(r: Rendered) -> list[str]:
    return [f.text for f in r.request.fields if f.is_tool]


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


@dataclass
class Group:
    key: str
    members: list[int] = field(default_factory=list)
    fingerprints: list[str] = field(default_factory=list)
    causes: Counter = field(default_factory=Counter)


def analyze(rendered: list[Rendered], normalized: list[Rendered], opt: Options,
            chat_template: str = "") -> tuple[list[Finding], list[dict]]:
    """Cross-request findings (first occurrence per code and field) and per-template hit-rate reports."""
    bs = opt.block_size
    actual, achievable = simulate([r.token_ids for r in rendered], bs), simulate([r.token_ids for r in normalized], bs)
    groups: dict[str, Group] = {}
    findings: dict[tuple[str, str], Finding] = {}
    counts: Counter = Counter()
    for i, r in enumerate(rendered):
        g = groups.setdefault(group_key(r.request), Group(group_key(r.request)))
        fp = fingerprint(r.request, chat_template)
        if fp not in g.fingerprints:
            g.fingerprints.append(fp)
        prior = g.members[-RECENT:]
        g.members.append(i)
        if not prior:
            continue
        ds = [(explain(rendered[j], r, bs), j) for j in prior]
        d, j = max(ds, key=lambda x: x[0].common_tokens)
        code, detail = classify(rendered[j], r, d)
        end = r.reusable_end(opt.prefix_tokens)
        lost = max(0, r.token_at(end) // bs * bs - actual[i])  # the reusable part that did not hit
        g.causes[f"{code} {RULES[code].title}" if code in RULES else code] += lost
        per_request = code.startswith("PC10") and code != "PC105"  # volatile values: already reported per request
        if code in RULES and not per_request and d.char < end:
            counts[code, d.location.field] += 1
            if (code, d.location.field) not in findings:
                rule, f = RULES[code], r.span_at(d.char).field
                line, col = r.request.location(f, d.location.char_offset)
                findings[code, d.location.field] = Finding(
                    r.request.path, line, col, code, rule.severity,
                    f"{rule.title} in {f.name} ({detail!r}) vs the request at line {rendered[j].request.line} "
                    f"(token {d.token_index}): costs {lost} prefix tokens", rule.fix, lost)
    for key, f in findings.items():
        if counts[key] > 1:
            f.message += f"; seen in {counts[key]} requests"
    reports = []
    for g in groups.values():
        total = sum(len(rendered[i].token_ids) for i in g.members)
        reports.append({
            "key": g.key, "requests": len(g.members), "first": f"{rendered[g.members[0]].request.path}:"
            f"{rendered[g.members[0]].request.line}", "fingerprints": g.fingerprints, "prompt_tokens": total,
            "actual_hit_rate": sum(actual[i] for i in g.members) / total,
            "achievable_hit_rate": sum(achievable[i] for i in g.members) / total,
            "causes": [{"cause": c, "tokens_lost": n} for c, n in g.causes.most_common() if n]})
    return list(findings.values()), reports
