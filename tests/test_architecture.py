"""The house rules, checked on the source: no import cycles, and each room imports only what
its ``__init__`` docstring allows (the compiler is pure, the runtime reads only the plan and the
program forms, the program forms read nothing of either half)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest
import repo_paths

PACKAGE = repo_paths.REPO / "autopar"

# room -> the autopar modules and packages it may import (besides itself)
ALLOWED: dict[str, tuple[str, ...]] = {
    "autopar.plan": ("autopar.errors", "autopar.ir"),
    "autopar.cluster": ("autopar.errors",),
    "autopar.calibration_samples": (),
    "autopar.method_options": ("autopar.errors",),
    "autopar.methods": ("autopar.plan", "autopar.ir", "autopar.errors", "autopar.method_options"),
    "autopar.models": ("autopar.errors",),
    "autopar.ir": ("autopar.errors",),
    "autopar.compiler": ("autopar.plan", "autopar.methods", "autopar.method_options",
                         "autopar.errors", "autopar.cluster", "autopar.calibration_samples",
                         "autopar.ir"),
    "autopar.runtime": ("autopar.plan", "autopar.ir", "autopar.cluster",
                        "autopar.calibration_samples", "autopar.errors"),
    "autopar.report": ("autopar.plan", "autopar.ir", "autopar.cluster", "autopar.compiler",
                       "autopar.errors"),
    "autopar.frontend": ("autopar.compiler", "autopar.methods", "autopar.method_options",
                         "autopar.plan", "autopar.ir", "autopar.cluster", "autopar.errors",
                         "autopar.version"),
}
# The command line is the top of the house: it may import anything, and nothing but the
# package's ``python -m autopar`` entry imports it.
TOP_ROOM = "autopar.cli"
TOP_ROOM_ENTRIES = ("autopar.__main__",)
MAX_TOP_LEVEL_MODULES = 12
# A module is read whole: past this many lines it holds more than one thing (Alpa's 2,000-line
# files are what made it hard to carry).
MAX_MODULE_LINES = 400
# The rooms a newcomer follows step by step (the driver, the planners), whose functions are
# held to a screen each.
SHORT_FUNCTION_ROOMS = ("runtime", "compiler/planners")
MAX_FUNCTION_LINES = 60


@dataclass(frozen=True)
class ImportEdge:
    source: str
    target: str
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_edges(root: Path) -> tuple[set[str], list[ImportEdge]]:
    """Every module under ``root`` and every import between them, wherever it stands (module
    level, inside a function, under ``TYPE_CHECKING``): a cycle through a lazy import is still
    a cycle of meaning. ``from pkg import sub`` with ``sub`` a module imports ``pkg.sub``."""
    files = {module_name(root, p): p for p in root.rglob("*.py")}
    modules = set(files)
    edges = []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module name
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.append(ImportEdge(name, target, node.lineno))
    return modules, edges


def cycles(edges: list[ImportEdge]) -> list[list[str]]:
    graph = nx.DiGraph((e.source, e.target) for e in edges)
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def room_violations(edges: list[ImportEdge]) -> list[str]:
    inside = _inside
    found = []
    for e in edges:
        for room, allowed in ALLOWED.items():
            if inside(e.source, room) and not inside(e.target, room) and not any(
                    inside(e.target, a) for a in allowed):
                found.append(f"{e.source}:{e.line} imports {e.target}")
    return found


def test_the_package_has_no_import_cycle():
    _, edges = import_edges(PACKAGE)
    assert cycles(edges) == []


def test_each_room_imports_only_what_it_may():
    _, edges = import_edges(PACKAGE)
    assert room_violations(edges) == []


def imports_of_the_top(edges: list[ImportEdge]) -> list[str]:
    """Imports of the command line from anywhere but itself and its entry points."""
    return [f"{e.source}:{e.line} imports {e.target}" for e in edges
            if _inside(e.target, TOP_ROOM) and not _inside(e.source, TOP_ROOM)
            and e.source not in TOP_ROOM_ENTRIES]


def test_nothing_imports_the_command_line():
    _, edges = import_edges(PACKAGE)
    assert imports_of_the_top(edges) == []


def test_the_top_level_is_a_short_list_and_the_compiler_is_in_rooms():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    loose = sorted(p.name for p in (PACKAGE / "compiler").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    for room in ("plan", "ir", "compiler", "runtime", "frontend", "report", "cli"):
        assert ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())), room


def long_modules(root: Path, limit: int) -> list[str]:
    """Modules under ``root`` with more than ``limit`` lines, with their length."""
    return sorted(f"{p.relative_to(root.parent).as_posix()}: {n} lines"
                  for p in root.rglob("*.py") if (n := len(p.read_text().splitlines())) > limit)


def long_functions(root: Path, rooms: tuple[str, ...], limit: int) -> list[str]:
    """Functions (methods and nested ones too) in ``rooms`` of ``root`` longer than ``limit``
    lines, from their ``def`` to their last line."""
    found = []
    for room in rooms:
        for path in sorted((root / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > limit:
                        found.append(f"{path.relative_to(root.parent).as_posix()}:"
                                     f"{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_is_over_the_line_limit():
    assert long_modules(PACKAGE, MAX_MODULE_LINES) == []


def test_the_runtime_and_planners_functions_are_short():
    assert long_functions(PACKAGE, SHORT_FUNCTION_ROOMS, MAX_FUNCTION_LINES) == []


def listed_modules(text: str) -> set[str]:
    """The module paths a page lists (`autopar/...py` in backticks)."""
    return set(re.findall(r"`(autopar/[\w/]+\.py)`", text))


def test_every_module_is_listed_in_the_architecture_page():
    listed = listed_modules((repo_paths.REPO / "docs" / "architecture.md").read_text())
    modules = {f"autopar/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.rglob("*.py")}
    assert sorted(modules - listed) == [], "modules missing from docs/architecture.md"
    assert sorted(listed - modules) == [], "docs/architecture.md lists modules that do not exist"


def test_the_listing_check_reads_paths_in_backticks_only():
    text = "- `autopar/api.py`: the shell\n- autopar/cli.py is named bare\n`autopar/ir/flatten.py`"
    assert listed_modules(text) == {"autopar/api.py", "autopar/ir/flatten.py"}


# ---- the checker itself can fail: a toy package with each kind of fault --------------------


def _toy(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "autopar"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_length_checks_find_a_long_module_and_a_long_method(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(5))
    root = _toy(tmp_path, {"runtime/driver.py": f"class Driver:\n    def run(self):\n{body}"
                                                "        return 0\n",
                           "ir/short.py": "def f():\n    return 1\n"})
    assert long_modules(root, 6) == ["autopar/runtime/driver.py: 8 lines"]
    assert long_functions(root, ("runtime", "ir"), 5) == [
        "autopar/runtime/driver.py:2 run: 7 lines"]
    assert long_functions(root, ("ir",), 1) == ["autopar/ir/short.py:1 f: 2 lines"]


def test_the_checker_finds_a_room_importing_the_command_line(tmp_path):
    root = _toy(tmp_path, {"__init__.py": "", "__main__.py": "from autopar.cli import main\n",
                           "cli/__init__.py": "from autopar.cli.main import main\n",
                           "cli/main.py": "import autopar.bench\nmain = 1\n",
                           "bench/__init__.py": "def run():\n    from autopar.cli import main\n"})
    assert imports_of_the_top(import_edges(root)[1]) == [
        "autopar.bench:2 imports autopar.cli.main"]


@pytest.mark.parametrize("lazy", [False, True])
def test_the_checker_finds_a_cycle(tmp_path, lazy):
    later = "def f():\n    from autopar.a import x\n" if lazy else "from autopar.a import x\n"
    root = _toy(tmp_path, {"__init__.py": "", "a.py": "from autopar.b import y\nx = 1\n",
                           "b.py": later + "y = 2\n"})
    assert cycles(import_edges(root)[1]) == [["autopar.a", "autopar.b"]]


def test_the_checker_reads_a_submodule_import_as_that_module(tmp_path):
    root = _toy(tmp_path, {"__init__.py": "from autopar import b\n", "a.py": "",
                           "b.py": "from autopar import a\n"})
    assert cycles(import_edges(root)[1]) == []


@pytest.mark.parametrize("target", ["autopar.runtime.shard", "autopar.frontend.planning",
                                    "autopar.report.text"])
def test_the_checker_finds_the_compiler_importing_a_room_above_it(tmp_path, target):
    root = _toy(tmp_path, {
        "__init__.py": "", "compiler/__init__.py": "", "runtime/__init__.py": "",
        "frontend/__init__.py": "", "report/__init__.py": "",
        "runtime/shard.py": "", "frontend/planning.py": "", "report/text.py": "",
        "compiler/planner.py": f"def plan():\n    import {target}\n",
    })
    assert room_violations(import_edges(root)[1]) == [
        f"autopar.compiler.planner:2 imports {target}"]
