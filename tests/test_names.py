"""Each method, schedule and solver name is written once, where it is defined (a ``StrEnum``
member, or the full search's and the schedule choice's ``"auto"``), and everywhere else
derived from that definition: a name typed again as a string literal is what lets two copies
drift apart. Docstrings may name them; code may not."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import repo_paths

from autopar.ir.schedules import ScheduleName
from autopar.method_options import SCHEDULE_AUTO, Solver
from autopar.methods import FULL_SEARCH
from autopar.plan import MethodName

PACKAGE = repo_paths.REPO / "autopar"
NAMES = frozenset({m.value for enum in (MethodName, ScheduleName, Solver) for m in enum}
                  | {FULL_SEARCH, SCHEDULE_AUTO})
# module-level constants that define a name (every other definition is a StrEnum member)
NAME_CONSTANTS = frozenset({"FULL_SEARCH", "SCHEDULE_AUTO"})


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _definitions(tree: ast.Module) -> set[int]:
    """The string constants assigned to a StrEnum's members or to a name constant."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id == "StrEnum" for b in node.bases):
            found |= {id(s.value) for s in node.body if isinstance(s, ast.Assign)}
    for s in tree.body:
        if isinstance(s, ast.Assign | ast.AnnAssign):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            if any(isinstance(t, ast.Name) and t.id in NAME_CONSTANTS for t in targets):
                found.add(id(s.value))
    return found


def name_literals(root: Path, names: frozenset[str]) -> tuple[list[str], list[str]]:
    """Where under ``root`` a string constant equal to one of ``names`` stands in code: its
    definitions and everything else, as ``path:line: 'name'``."""
    defined, elsewhere = [], []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        skip, definitions = _docstrings(tree), _definitions(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value in names and id(node) not in skip):
                where = f"{path.relative_to(root.parent)}:{node.lineno}: {node.value!r}"
                (defined if id(node) in definitions else elsewhere).append(where)
    return defined, elsewhere


def test_method_schedule_and_solver_names_are_literals_only_where_defined():
    defined, elsewhere = name_literals(PACKAGE, NAMES)
    assert not elsewhere, "names typed again instead of read from their definition:\n" + \
        "\n".join(elsewhere)
    # one definition per name; "auto" is also each option's (solver, full search, schedule,
    # remat, replicas, stages, layers), one per option
    counts = Counter(d.rsplit(": ", 1)[1] for d in defined)
    assert {name: counts[repr(name)] for name in NAMES - {"auto"}} == dict.fromkeys(
        NAMES - {"auto"}, 1)
    assert counts["'auto'"] >= 3


def test_the_check_finds_a_name_typed_again(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "a.py").write_text(
        '"""Says "data" in a docstring, which is allowed."""\n'
        "from enum import StrEnum\n\n\n"
        "class Kind(StrEnum):\n"
        '    DATA = "data"\n\n\n'
        "FULL_SEARCH = \"auto\"\n\n\n"
        "def f(x):\n"
        '    """Docstrings may say "pipeshard"."""\n'
        '    return x == "pipeshard" or x == Kind.DATA\n')
    defined, elsewhere = name_literals(root, frozenset({"data", "pipeshard", "auto"}))
    assert sorted(defined) == ["pkg/a.py:6: 'data'", "pkg/a.py:9: 'auto'"]
    assert elsewhere == ["pkg/a.py:14: 'pipeshard'"]
