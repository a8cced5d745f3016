"""Collectives of compiled HLO by where they run: inside a while loop's body (every iteration)
or outside every loop (once per step), read from the module's call graph
(``runtime.hlo_calls``); a scanned model's per-layer communication is what its while bodies
hold."""

import re

from autopar.runtime.hlo import CollectiveSummary, parse_collectives
from autopar.runtime.hlo_calls import call_sites


def loop_computations(hlo_text: str) -> set[str]:
    """Every computation that runs inside some while loop's body (called from it, directly or
    not)."""
    _, sites = call_sites(hlo_text)
    calls: dict[str, set[str]] = {}
    for callee, found in sites.items():
        for site in found:
            calls.setdefault(site.caller, set()).add(callee)
    inside: set[str] = set()
    todo = [callee for callee, found in sites.items() if any(s.role == "body" for s in found)]
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
    bodies = {c for c, found in call_sites(hlo_text)[1].items()
              if any(s.role == "body" for s in found)}
    return len(re.findall(r"=\s*\S+\s+while\(", hlo_text)) or len(bodies)


def program_while_lines(hlo_text: str) -> list[str]:
    """The while instructions of the program's own loops (``lax.scan``, ``fori_loop``,
    ``while_loop``: JAX names them ``.../while``), without the loops XLA:CPU makes of one
    operation (its scatter expander turns a scatter-add into a loop over the updates, named
    after the scatter; the tests' XLA flags take the path that does)."""
    return [line for line in hlo_text.splitlines() if " while(" in line
            and re.search(r'op_name="[^"]*/while"', line)]
