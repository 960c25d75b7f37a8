"""Command-line options derived from Config, so every engine knob is a flag with Config's own default, and a
TOML file (`--config`) that sets the same options. Precedence: flags, then the file, then Config's defaults."""
import argparse
import inspect
import re
import tomllib
import types
from dataclasses import MISSING, fields

from prefixcache.config import Config

SKIP = {"shared_prefixes"}  # token ids: the server takes --shared-prefixes FILE of system-prompt strings
FIELD = re.compile(r"^    (\w+): [^=]+ = ")  # a field of Config's source, with its default
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?)?\s*$", re.I)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One flag per Config field, e.g. --kv-cache-bytes 512MiB, --no-enable-prefix-cache."""
    group = parser.add_argument_group("engine (Config)")
    for f in fields(Config):
        if f.name in SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base(f.type)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=f"(default: {f.default})")
        else:
            group.add_argument(flag, type=size if kind is int else kind, default=None, help=f"(default: {f.default})")


def resolve(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(Config's options, the `extra` non-engine options) as given by flags and the --config file."""
    engine_names = {f.name for f in fields(Config)} - SKIP
    values = {}
    if getattr(args, "config", None):
        with open(args.config, "rb") as fh:
            values = tomllib.load(fh)
        unknown = set(values) - engine_names - set(extra)
        if unknown:
            raise ValueError(f"{args.config}: unknown option(s) {sorted(unknown)}; "
                             f"known: {sorted(engine_names | set(extra))}")
    for name in engine_names | set(extra):
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
    return ({k: v for k, v in values.items() if k in engine_names},
            {k: v for k, v in values.items() if k in extra})


def default(name: str):
    """Config's default for one option, for tools (bench, lint) whose own options mirror the engine's."""
    return Config.__dataclass_fields__[name].default


def size(text: str) -> int:
    """An integer, or a byte size such as 512MiB, 2G or 1.5GB (binary units)."""
    m = SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not an integer or size: {text!r}")
    number, unit = float(m.group(1)), (m.group(2) or "").upper()[:1]
    return int(number * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit])


def _base(annotation) -> type:
    """int for `int`, float for `float | None`, ..."""
    if isinstance(annotation, types.UnionType):
        return next(a for a in annotation.__args__ if a is not type(None))
    return annotation


def table() -> str:
    """The engine options as a markdown table: flag, Config's default and its comment there (the README's copy is
    checked against this)."""
    notes: dict[str, str] = {}
    name = None
    for line in inspect.getsource(Config).splitlines():
        field = FIELD.match(line)
        comment = line.partition("  # ")[2] if field else line.strip().removeprefix("# ")
        if field:
            name = field.group(1)
            notes[name] = comment
        elif line.strip().startswith("#") and name and not comment.endswith(":"):
            notes[name] += " " + comment
        else:
            name = None  # a blank line, a section's heading or a method: no field's comment goes on
    rows = ["| flag | default | |", "|---|---|---|"]
    for f in fields(Config):
        if f.name not in SKIP:
            value = f.default if f.default is not MISSING else f.default_factory()
            rows.append(f"| `--{f.name.replace('_', '-')}` | `{value!r}` | {notes[f.name].replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
