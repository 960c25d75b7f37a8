"""Findings and their output: `file:line:col: CODE: message (hint)` lines, or JSON."""
import json
from dataclasses import asdict, dataclass, field


@dataclass
class Finding:
    file: str
    line: int
    col: int
    code: str
    severity: str  # "error" | "warning"
    message: str
    hint: str
    cost_tokens: int = 0  # prefix tokens lost (errors) or put at risk (warnings)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.code}: {self.message} ({self.hint})"


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    fingerprints: list[dict] = field(default_factory=list)  # {"file", "line", "fingerprint", "static_tokens"}
    groups: list[dict] = field(default_factory=list)  # from --requests: per-template hit rates and causes

    @property
    def errors(self) -> int:
        return sum(f.severity == "error" for f in self.findings)

    def to_json(self) -> str:
        return json.dumps({"findings": [asdict(f) for f in self.findings], "fingerprints": self.fingerprints,
                           "groups": self.groups, "errors": self.errors}, indent=2)

    def to_text(self) -> str:
        lines = [str(f) for f in self.findings]
        lines += [f"{p['file']}:{p['line']}: template fingerprint {p['fingerprint']} "
                  f"({p['static_tokens']} static tokens)"
                  for p in self.fingerprints]
        for g in self.groups:
            lines.append(f"template {g['key']} ({g['requests']} requests, first at {g['first']}, "
                         f"versions {', '.join(g['fingerprints'])}): hit rate {g['actual_hit_rate']:.1%} actual, "
                         f"{g['achievable_hit_rate']:.1%} achievable ({g['prompt_tokens']} prompt tokens)")
            lines += [f"  {c['tokens_lost']:>8} tokens lost: {c['cause']}" for c in g["causes"]]
        warnings = len(self.findings) - self.errors
        lines.append(f"{self.errors} error(s), {warnings} warning(s)")
        return "\n".join(lines)
