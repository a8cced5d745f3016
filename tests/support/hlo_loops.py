"""Collectives of compiled HLO by where they run: inside a while loop's body (every iteration)
or outside every loop (once per step). ``count_collectives`` counts statically; a scanned
model's per-layer communication is what its while bodies hold."""

import re

from autopar.runtime.hlo import CollectiveSummary, parse_collectives

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_CALLED = re.compile(
    r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")


def _calls(hlo_text: str) -> tuple[dict[str, set[str]], set[str]]:
    """computation -> computations it calls; and the while bodies."""
    calls: dict[str, set[str]] = {}
    bodies: set[str] = set()
    current = ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and " = " not in line.split("(", 1)[0]:
            current = head.group(1)
            calls.setdefault(current, set())
            continue
        called = set(_CALLED.findall(line))
        for group in _BRANCHES.findall(line):
            called |= {name.strip().lstrip("%") for name in group.split(",") if name.strip()}
        calls.setdefault(current, set()).update(called)
        bodies.update(_WHILE_BODY.findall(line))
    return calls, bodies


def loop_computations(hlo_text: str) -> set[str]:
    """Every computation that runs inside some while loop's body (called from it, directly or
    not)."""
    calls, bodies = _calls(hlo_text)
    inside, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name in inside:
            continue
        inside.add(name)
        todo.extend(calls.get(name, ()))
    return inside


def split_by_loop(hlo_text: str) -> tuple[CollectiveSummary, CollectiveSummary]:
    """(collectives inside while bodies, collectives outside every loop)."""
    inside = loop_computations(hlo_text)
    found = parse_collectives(hlo_text)
    return (CollectiveSummary([c for c in found if c.computation in inside]),
            CollectiveSummary([c for c in found if c.computation not in inside]))


def while_loop_count(hlo_text: str) -> int:
    """How many while instructions the module has."""
    return len(re.findall(r"=\s*\S+\s+while\(", hlo_text)) or len(_calls(hlo_text)[1])
