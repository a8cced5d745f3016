"""Which computations of a compiled HLO module run, and how often: the call graph read from
the module's text (``runtime.hlo`` counts collectives by it)."""

from __future__ import annotations

import re

__all__ = ["COMPUTATION_RE", "computation_runs"]

# a computation's header line: ``%name (params) -> result {``, ``ENTRY`` for the entry
COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_CALLEE_RE = re.compile(r"\b(body|condition|to_apply|calls|true_computation|"
                        r"false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def computation_runs(hlo_text: str) -> dict[str, int]:
    """How many times each computation of an HLO module runs in one run of its entry: a
    while loop's body as many times as its known trip count (XLA's ``known_trip_count``,
    which a ``lax.scan`` has; once where XLA does not know it), its condition once more,
    every other called computation once per run of its caller."""
    sites: dict[str, list[tuple[str, int]]] = {}  # callee -> (caller, runs per caller run)
    entry, current = "", ""
    for line in hlo_text.splitlines():
        head = COMPUTATION_RE.match(line)
        if head and " = " not in line.split("(", 1)[0]:
            current = head.group(1)
            if line.lstrip().startswith("ENTRY"):
                entry = current
            continue
        trip = _TRIP_RE.search(line)
        n = int(trip.group(1)) if trip else 1
        for role, callee in _CALLEE_RE.findall(line):
            factor = n if role == "body" else n + 1 if role == "condition" else 1
            sites.setdefault(callee, []).append((current, factor))
        for group in _BRANCHES_RE.findall(line):
            for callee in group.split(","):
                if callee.strip():
                    sites.setdefault(callee.strip().lstrip("%"), []).append((current, 1))
    runs: dict[str, int] = {entry: 1}

    def count(name: str) -> int:
        if name not in runs:
            runs[name] = 0  # a call cycle (none in valid HLO) adds nothing
            runs[name] = sum(count(caller) * factor for caller, factor in sites.get(name, ()))
        return runs[name]

    for name in sites:
        count(name)
    return runs
