"""docs/ARCHITECTURE.md against the code: it names every module and only modules that exist, no import runs back
up one of its floors, and the router imports no torch. And the README's table of engine options is Config's."""
import ast
import re
import subprocess
import sys
from pathlib import Path

from prefixcache.options import table

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "ARCHITECTURE.md"


def mapped() -> dict[str, int]:
    """Each module the map names (prefixcache/...) and the floor it stands on: the '### N.' heading above it."""
    out, floor = {}, None
    for line in MAP.read_text().splitlines():
        if m := re.match(r"### (\d+)\. ", line):
            floor = int(m.group(1))
        elif line.startswith("## "):
            floor = None
        elif floor and (m := re.match(r"- `([\w/]+\.py)`: ", line)):
            assert m.group(1) not in out, f"{m.group(1)} is named twice"
            out[f"prefixcache/{m.group(1)}"] = floor
    return out


def modules() -> set[str]:
    """Every module of the package; an empty __init__.py is a folder's marker, not a module."""
    return {str(p.relative_to(ROOT)) for p in (ROOT / "prefixcache").rglob("*.py")
            if p.name != "__init__.py" or p.read_text().strip()}


def imported(path: str) -> set[str]:
    """The package's modules that a module imports (at the top or inside a function), as paths."""
    out = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "prefixcache":
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            base = ROOT / name.replace(".", "/")
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.exists() and str(candidate.relative_to(ROOT)) in modules():
                    out.add(str(candidate.relative_to(ROOT)))
    return out - {path}


def test_the_map_names_every_module_and_no_other():
    names, real = set(mapped()), modules()
    assert not real - names, f"modules the map does not name: {sorted(real - names)}"
    assert not names - real, f"the map names modules that do not exist: {sorted(names - real)}"


def test_no_import_runs_back_up_a_floor():
    floors = mapped()
    up = [f"{m} (floor {floors[m]}) imports {i} (floor {floors[i]})"
          for m in sorted(floors) for i in sorted(imported(m)) if floors[i] > floors[m]]
    assert not up, "\n".join(up)


def test_the_router_imports_no_torch():
    run = subprocess.run([sys.executable, "-c", "import prefixcache.router.app, sys; "
                          "print(sorted(m for m in ('torch', 'transformers', 'prefixcache.engine') "
                          "if m in sys.modules))"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_readme_lists_the_engine_options_with_configs_defaults():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- engine-options -->\n", 1)[1].split("\n<!-- /engine-options -->", 1)[0]
    assert block == table(), "README.md's engine options differ from Config: paste `python -m prefixcache.options`"
