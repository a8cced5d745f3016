"""The intra-operator sharding ILP as plain data, its solution, and ``solve``.

Each node picks one strategy; an edge (u, v) costs ``costs[i][j]`` when u picks i and v picks j;
the objective is the sum of chosen node and edge costs, optionally under a per-device memory
budget over live sets. Nothing here knows about JAX: the builder in ``intra_op.py`` makes the
problem, ``solve`` answers it (exact presolve in ``ilp_presolve.py``, the MIP and its solvers
in ``ilp_mip.py``). The ``--dump-ilp`` JSON format is described in docs/ilp-format.md.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from autopar.compiler.ilp_mip import (
    MIP_REL_GAP,
    SOLVERS,
    build_mip,
    lp_rounding,
    resolve_auto,
    run_mip,
    solver_name,
)
from autopar.compiler.ilp_presolve import complete_choices, local_search
from autopar.compiler.ilp_presolve import presolve as reduce_problem
from autopar.errors import AutoparError, InvalidOptionError, PlanError

__all__ = ["SOLVERS"]  # re-exported: the CLI and options list the valid solver names
FORMAT_VERSION = 1
# A gap this loose or looser is first tried by rounding the LP relaxation (a proof when the
# rounded plan is within the gap of the LP's bound); tighter gaps go straight to the MIP.
LP_ROUNDING_MIN_GAP = 1e-4
WARM_START = True  # hand the greedy plan to the solver (a switch for measurements)


@dataclass
class ProblemNode:
    """One ILP decision: a node (with what follows it) and its candidate strategies."""

    name: str
    costs: list[float]
    strategy_names: list[str]
    memory: list[float] | None = None
    follow_note: str = ""


@dataclass
class ProblemEdge:
    """Resharding cost ``costs[i][j]`` when ``src`` picks strategy i and ``dst`` picks j."""

    src: int
    dst: int
    costs: list[list[float]]
    note: str = ""


@dataclass
class IntraOpProblem:
    """The whole ILP: nodes, edges, optional per-device memory budget and its live sets."""

    nodes: list[ProblemNode]
    edges: list[ProblemEdge]
    memory_budget: float | None = None
    live_sets: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The ``--dump-ilp`` problem section (format version 1)."""
        budget = self.memory_budget
        return {"format": "autopar-ilp", "version": FORMAT_VERSION,
                "memory_budget": None if budget is None else float(budget),
                "nodes": [{"name": n.name, "strategies": list(n.strategy_names),
                           "costs": [float(c) for c in n.costs],
                           "memory": None if n.memory is None else [float(m) for m in n.memory],
                           "follow_note": n.follow_note} for n in self.nodes],
                "edges": [{"src": e.src, "dst": e.dst, "note": e.note,
                           "costs": [[float(c) for c in row] for row in e.costs]}
                          for e in self.edges],
                "live_sets": [[int(u) for u in s] for s in self.live_sets]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IntraOpProblem:
        """Inverse of ``to_dict``; ignores a ``solution`` section."""
        if d.get("format") != "autopar-ilp" or d.get("version") != FORMAT_VERSION:
            raise PlanError(f"not an autopar ILP dump of format version {FORMAT_VERSION}: "
                            f"format={d.get('format')!r} version={d.get('version')!r}")
        nodes = [ProblemNode(n["name"], [float(c) for c in n["costs"]], list(n["strategies"]),
                             None if n.get("memory") is None else [float(m) for m in n["memory"]],
                             n.get("follow_note", "")) for n in d["nodes"]]
        edges = [ProblemEdge(int(e["src"]), int(e["dst"]),
                             [[float(c) for c in row] for row in e["costs"]], e.get("note", ""))
                 for e in d["edges"]]
        budget = d.get("memory_budget")
        return cls(nodes, edges, None if budget is None else float(budget),
                   [[int(u) for u in s] for s in d.get("live_sets", [])])

    def to_json(self) -> str:
        """JSON text of ``to_dict()`` (strict JSON: costs are finite)."""
        return problem_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> IntraOpProblem:
        """Inverse of ``to_json`` / ``problem_to_json``."""
        return cls.from_dict(json.loads(text))


@dataclass
class IntraOpSolution:
    """A chosen strategy per node and how the solver got there."""

    choices: list[int]
    objective: float
    status: str  # "optimal" | "time_limit" (feasible, not proven optimal) | "trivial"
    proven_optimal: bool
    gap: float | None
    solver: str  # "highs" | "cbc" | "presolve" (solved exactly without a MIP) | "trivial"
    num_variables: int
    num_constraints: int
    build_time_s: float
    solve_time_s: float
    ilp_nodes: int = 0  # nodes / edges left for the MIP after presolve
    ilp_edges: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able stats: every field but ``choices`` (what goes in ``Plan.solver``)."""
        d = asdict(self)
        del d["choices"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IntraOpSolution:
        """From a dump's ``solution`` section (``to_dict()`` plus ``choices``)."""
        names = [f for f in cls.__dataclass_fields__ if f in d]
        return cls(**{f: d[f] for f in names})


class InfeasibleMemoryError(AutoparError, ValueError):
    """No choice of strategies fits the per-device memory budget."""

    def __init__(self, budget: float, min_peak_bytes: float, dominant: str = ""):
        self.budget = budget
        self.min_peak_bytes = min_peak_bytes
        self.dominant = dominant
        have, need = _fmt_bytes(budget), _fmt_bytes(min_peak_bytes)
        if have == need:  # rounding hid the difference: show exact bytes
            have, need = f"{budget:.0f} bytes", f"{min_peak_bytes:.0f} bytes"
        most = f", most of it {dominant}" if dominant else ""
        super().__init__(f"no sharding plan fits in {have} per device; the smallest per-device "
                         f"memory any plan needs is {need}{most}")


def _fmt_bytes(b: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def problem_to_json(problem: IntraOpProblem, solution: IntraOpSolution | None = None) -> str:
    """The ``--dump-ilp`` text: the problem and, when given, the solution with its stats."""
    d = problem.to_dict()
    if solution is not None:
        d["solution"] = {
            "choices": list(solution.choices),
            "strategies": [n.strategy_names[c] for n, c in zip(problem.nodes, solution.choices,
                                                                strict=True)],
            **solution.to_dict(),
        }
    # One node / edge / live set per line: greppable and diffable, yet compact.
    parts = []
    for key, value in d.items():
        text = json.dumps(value, allow_nan=False)
        if isinstance(value, list) and value:
            text = "[\n  " + ",\n  ".join(json.dumps(x, allow_nan=False) for x in value) + "\n ]"
        parts.append(f"{json.dumps(key)}: {text}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


# ---------------------------------------------------------------- evaluation ----------------

def _check(problem: IntraOpProblem) -> None:
    """Malformed problems are the builder's bug: a plain ValueError naming the culprit."""
    n, sizes = len(problem.nodes), [len(nd.costs) for nd in problem.nodes]
    for u, nd in enumerate(problem.nodes):
        if not sizes[u] or len(nd.strategy_names) != sizes[u] or not np.all(np.isfinite(
                nd.costs)) or (nd.memory is not None and len(nd.memory) != sizes[u]):
            raise ValueError(f"node {u} ({nd.name}): needs >= 1 strategy, finite costs and "
                             "equally long costs, strategy_names and memory")
    for e in problem.edges:
        if not (0 <= e.src < n and 0 <= e.dst < n) or np.shape(e.costs) != (
                sizes[e.src], sizes[e.dst]) or not np.all(np.isfinite(e.costs)):
            raise ValueError(f"edge {e.src}->{e.dst}: needs node indices in range and finite "
                             "costs of shape [src strategies][dst strategies]")
    if any(not 0 <= u < n for s in problem.live_sets for u in s):
        raise ValueError("live set: node index out of range")


def _check_choices(problem: IntraOpProblem, choices: Sequence[int]) -> None:
    if len(choices) != len(problem.nodes) or any(
            not 0 <= c < len(nd.costs) for c, nd in zip(choices, problem.nodes, strict=True)):
        raise ValueError("choices: need one valid strategy index per node")


def evaluate(problem: IntraOpProblem, choices: Sequence[int]) -> float:
    """Objective (seconds) of ``choices``: chosen node costs plus chosen edge costs."""
    _check_choices(problem, choices)
    total = math.fsum(nd.costs[c] for nd, c in zip(problem.nodes, choices, strict=True))
    return total + math.fsum(e.costs[choices[e.src]][choices[e.dst]] for e in problem.edges)


def peak_memory(problem: IntraOpProblem, choices: Sequence[int]) -> float:
    """Largest per-device memory over the live sets (each a set of nodes) for ``choices``."""
    _check_choices(problem, choices)
    mem = [0.0 if nd.memory is None else nd.memory[c]
           for nd, c in zip(problem.nodes, choices, strict=True)]
    return max((math.fsum(mem[u] for u in set(s)) for s in problem.live_sets), default=0.0)


def least_memory_choices(problem: IntraOpProblem) -> list[int]:
    """Every node at its least-memory strategy: the plan of least peak memory."""
    return [0 if nd.memory is None else int(np.argmin(nd.memory)) for nd in problem.nodes]


def min_peak_memory(problem: IntraOpProblem, *, solver: str = "auto",
                    time_limit_s: float = 30.0) -> float:
    """Smallest peak memory any plan has. Exact and solver-free: every live-set sum grows with
    each node's own memory, so each node at its least-memory strategy minimises all of them at
    once. ``solver``/``time_limit_s`` are only checked, for a uniform signature."""
    solver_name(solver)
    return peak_memory(problem, least_memory_choices(problem))


def brute_force(problem: IntraOpProblem) -> tuple[list[int], float]:
    """Best choices within the memory budget by enumerating every combination (for tests)."""
    _check(problem)
    shape = [len(nd.costs) for nd in problem.nodes]
    if math.prod(shape) > 1_000_000:
        raise ValueError(f"brute_force: {math.prod(shape)} combinations is too many")
    if not shape:
        return [], 0.0
    grid = np.indices(shape).reshape(len(shape), -1)  # grid[u]: u's pick in each combination
    total = np.zeros(grid.shape[1])
    for u, nd in enumerate(problem.nodes):
        total += np.asarray(nd.costs)[grid[u]]
    for e in problem.edges:
        total += np.asarray(e.costs)[grid[e.src], grid[e.dst]]
    if problem.memory_budget is not None:
        for s in problem.live_sets:
            load = np.zeros(grid.shape[1])
            for u in set(s):
                if problem.nodes[u].memory is not None:
                    load += np.asarray(problem.nodes[u].memory)[grid[u]]
            total[load > problem.memory_budget] = np.inf
    best = int(np.argmin(total))
    if not np.isfinite(total[best]):
        raise InfeasibleMemoryError(problem.memory_budget, min_peak_memory(problem))
    choices = [int(c) for c in grid[:, best]]
    return choices, evaluate(problem, choices)


def solve(problem: IntraOpProblem, *, solver: str = "auto", time_limit_s: float = 30.0,
          presolve: bool = True, relative_gap: float = MIP_REL_GAP) -> IntraOpSolution:
    """Cheapest choices within the memory budget.

    The solver gets what is left of ``time_limit_s`` after presolve and model building (at least
    0.05 s); PuLP's hand-over to it and CBC's overshoot come on top (docs/ilp-format.md). On the
    limit, the better of the solver's incumbent and the greedy start plan comes back with status
    "time_limit". Raises ``InfeasibleMemoryError`` when no plan fits the budget.
    ``presolve=False`` keeps every node in the MIP (for tests and measurements).
    ``relative_gap``: the solver stops once its incumbent is within this fraction of its bound
    (default 1e-9: optimal up to solver tolerances; a looser gap "optimal" means within it).
    """
    t0 = time.perf_counter()
    name = solver_name(solver)
    if not time_limit_s > 0:
        raise InvalidOptionError(f"time_limit_s must be positive, got {time_limit_s}")
    _check(problem)
    n, budget = len(problem.nodes), problem.memory_budget
    if budget is not None and (need := min_peak_memory(problem)) > budget:
        raise InfeasibleMemoryError(budget, need)
    if all(len(nd.costs) == 1 for nd in problem.nodes):
        return IntraOpSolution([0] * n, evaluate(problem, [0] * n), "trivial", True, 0.0,
                               "trivial", 0, 0, time.perf_counter() - t0, 0.0)
    r = reduce_problem(problem, presolve)
    if not r.cost:  # presolve decided every node exactly
        choices = complete_choices(r, n, {})
        return IntraOpSolution(choices, evaluate(problem, choices), "optimal", True, 0.0,
                               "presolve", 0, 0, time.perf_counter() - t0, 0.0)
    if name == "auto":
        name = resolve_auto()
    # Greedy plans from the cheapest and from the least-memory choices (the latter always fits:
    # the budget was checked): the solver's warm start, and the answer if it finds no better.
    cheap = {u: int(np.argmin(c)) for u, c in r.cost.items()}
    lean = {**cheap, **{u: int(np.argmin(d)) for terms, _ in r.rows for u, d in terms}}
    greedy = [g for g in (local_search(r, cheap), local_search(r, lean) if r.rows else None)
              if g is not None]
    plans = [complete_choices(r, n, g) for g in greedy]
    best = min(range(len(plans)), key=lambda i: evaluate(problem, plans[i]))
    model = build_mip(r, greedy[best] if WARM_START else None)
    if name == "highs" and relative_gap >= LP_ROUNDING_MIN_GAP:
        # The LP relaxation is tight on these problems but fractional: its rounding, polished,
        # is often within the gap of the LP's bound, which proves it without a MIP search.
        bound, rounded = lp_rounding(model, max(time_limit_s - (time.perf_counter() - t0), 0.05))
        start = local_search(r, rounded) if rounded else None
        if start is not None:
            plan = complete_choices(r, n, start)
            value, lower = evaluate(problem, plan), r.const + model.scale * bound
            if value - lower <= relative_gap * abs(value):
                t1 = time.perf_counter()
                return IntraOpSolution(
                    plan, value, "optimal", True, max(0.0, value - lower) / abs(value) if value
                    else 0.0, "highs-lp", model.num_columns, model.num_rows, t1 - t0, 0.0,
                    len(r.cost), sum(len(a) for a in r.adj.values()) // 2)
            plans.append(plan)
    t1 = time.perf_counter()
    result = run_mip(model, name, max(time_limit_s - (t1 - t0), 0.05), relative_gap)
    t2 = time.perf_counter()
    if result.status != "none":
        plans.append(complete_choices(r, n, result.core))
    plans = [p for p in plans if budget is None or peak_memory(problem, p) <= budget * (1 + 1e-9)]
    if not plans:  # unreachable while the least-memory plan fits; kept as a guard
        raise AutoparError(f"the ILP solver found no plan within time_limit_s={time_limit_s:g}; "
                           "raise the time limit")
    choices = min(plans, key=lambda p: evaluate(problem, p))
    optimal = result.status == "optimal"
    objective, gap = evaluate(problem, choices), (0.0 if optimal else None)
    if result.bound is not None and objective:  # in original units: constant + scaled MIP's
        gap = max(0.0, objective - (r.const + model.scale * result.bound)) / abs(objective)
    return IntraOpSolution(
        choices, objective, "optimal" if optimal else "time_limit", optimal, gap, name,
        model.num_columns, model.num_rows, t1 - t0, t2 - t1, len(r.cost),
        sum(len(a) for a in r.adj.values()) // 2)
