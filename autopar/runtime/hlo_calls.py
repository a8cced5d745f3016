"""Which computations of a compiled HLO module run, and how often: the call graph read from
the module's text (``runtime.hlo`` counts collectives by it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["COMPUTATION_RE", "CallSite", "call_sites", "computation_runs"]

# a computation's header line: ``%name (params) -> result {``, ``ENTRY`` for the entry
COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_CALLEE_RE = re.compile(r"\b(body|condition|to_apply|calls|true_computation|"
                        r"false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass(frozen=True)
class CallSite:
    """One call of a computation: the computation that calls it, as what (``body`` or
    ``condition`` of a while loop, ``to_apply``, ``calls``, a conditional's branch), and how
    many times per run of the caller (a loop's body: its known trip count, 1 where XLA does
    not know it; its condition once more; anything else once)."""

    caller: str
    role: str
    runs: int


def call_sites(hlo_text: str) -> tuple[str, dict[str, list[CallSite]]]:
    """The module's entry computation, and every called computation's call sites."""
    sites: dict[str, list[CallSite]] = {}
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
            runs = n if role == "body" else n + 1 if role == "condition" else 1
            sites.setdefault(callee, []).append(CallSite(current, role, runs))
        for group in _BRANCHES_RE.findall(line):
            for callee in group.split(","):
                if callee.strip():
                    sites.setdefault(callee.strip().lstrip("%"), []).append(
                        CallSite(current, "branch", 1))
    return entry, sites


def computation_runs(hlo_text: str) -> dict[str, int]:
    """How many times each computation of an HLO module runs in one run of its entry (see
    ``CallSite.runs``): a while loop's body as many times as its known trip count (which a
    ``lax.scan`` has), every other called computation once per run of its caller."""
    entry, sites = call_sites(hlo_text)
    runs: dict[str, int] = {entry: 1}

    def count(name: str) -> int:
        if name not in runs:
            runs[name] = 0  # a call cycle (none in valid HLO) adds nothing
            runs[name] = sum(count(s.caller) * s.runs for s in sites.get(name, ()))
        return runs[name]

    for name in sites:
        count(name)
    return runs
