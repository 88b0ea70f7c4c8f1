"""The house's layout holds: every module imports alone, no import circle, and no arrow
runs back up between packages (docs/architecture.md, "Rules of the house").

Read from the source with ``ast`` (every import counts: top-level, inside functions and
under ``TYPE_CHECKING``, since each is an arrow a reader follows), and checked by
importing each module in a fresh interpreter (a circle between top-level imports fails
there as a partially initialised module).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import ROOT

PKG = ROOT / "extractedprism"

# Lower layers never import higher ones; a package may import its own modules and any
# lower layer. The top-level modules errors.py and threads.py are the floor; cli.py and
# app.py the roof (the wiring).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "threads", "heap", "__init__"),
    ("config", "logs", "files"),
    ("upstreams",),
    ("checks", "discovery", "datapath"),
    ("health", "ops"),
    ("app",),
    ("cli",),
    ("__main__",),
)
LEVEL = {name: n for n, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The product modules a file imports (``from a.b import c`` counts a.b.c when that is
    a module of ours, else a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if f"{node.module}.{a.name}" in MODULES)
    return {m for m in found if m in MODULES and m != "extractedprism"}


def _unit(module: str) -> str:
    """The package (or top-level module) a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_every_package_and_top_level_module_has_a_layer() -> None:
    assert {_unit(m) for m in MODULES} <= set(LEVEL), set(map(_unit, MODULES)) - set(LEVEL)


def test_no_arrow_runs_back_up_between_packages() -> None:
    wrong = sorted(f"{m} -> {dep}" for m, deps in GRAPH.items() for dep in deps
                   if _unit(dep) != _unit(m) and LEVEL[_unit(dep)] >= LEVEL[_unit(m)])
    assert not wrong, "imports that run sideways or back up:\n" + "\n".join(wrong)


def test_no_import_circle_between_modules() -> None:
    # Depth-first search for a back edge; report the circle it closes.
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(GRAPH[m]):
            if state.get(dep) == 1:
                circles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


@pytest.mark.timeout(120)
def test_each_module_imports_alone() -> None:
    # One fresh interpreter per module, all at once: an import that only works after
    # another module was imported first fails here.
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], cwd=ROOT,
                                 stderr=subprocess.PIPE, text=True)
             for m in MODULES if not m.endswith("__main__")}
    failed = {}
    for m, proc in procs.items():
        _, err = proc.communicate(timeout=100)
        if proc.returncode != 0:
            failed[m] = err.strip().splitlines()[-1:]
    assert not failed, failed
