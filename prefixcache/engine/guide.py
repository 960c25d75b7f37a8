"""A request's guide (a JSON schema, any JSON object, a regex or a choice of strings) and how xgrammar compiles it:
the grammar thread (engine/grammar.py) and the trial in a worker process (engine/grammar_trial.py) compile it alike."""
import json
from dataclasses import dataclass
from typing import Literal

import xgrammar as xgr

KINDS = ("json_object", "json_schema", "regex", "choice")


@dataclass(frozen=True)
class Guide:
    kind: Literal["json_object", "json_schema", "regex", "choice"]
    spec: str = ""  # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON list of strings

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"guide kind must be one of {KINDS}, got {self.kind!r}")

    def compile(self, compiler: xgr.GrammarCompiler) -> xgr.CompiledGrammar:
        """The guide's grammar; raises ValueError if the schema or pattern does not compile."""
        try:
            if self.kind in ("json_object", "json_schema"):
                schema = self.spec if self.kind == "json_schema" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if self.kind == "regex":
                return compiler.compile_regex(self.spec)
            return compiler.compile_regex("|".join(_escape(c) for c in json.loads(self.spec)))
        except RuntimeError as e:  # xgrammar's error for a schema or pattern it cannot compile
            raise ValueError(f"cannot compile the {self.kind} guide: {e}") from None


def _escape(text: str) -> str:
    """A literal string as a regex (xgrammar's dialect: escape every metacharacter)."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)
