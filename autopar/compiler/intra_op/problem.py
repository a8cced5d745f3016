"""The intra-operator sharding ILP as plain data (nodes, edges, memory budget and live sets),
its solution, and the ``--dump-ilp`` JSON form (docs/ilp-format.md). Nothing here solves:
``ilp.solve`` does, with ``presolve`` and ``mip``; all three read these types.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from autopar.errors import AutoparError, PlanError, format_bytes

FORMAT_VERSION = 1


@dataclass
class ProblemNode:
    """One ILP decision: a node (with what follows it) and its candidate strategies."""

    name: str
    costs: list[float]
    strategy_names: list[str]
    memory: list[float] | None = None
    follow_note: str = ""


@dataclass(eq=False)
class ProblemEdge:
    """Resharding cost ``costs[i][j]`` when ``src`` picks strategy i and ``dst`` picks j.

    Held as one float array (given as rows or as an array): the builder makes it with numpy
    and every solver reads it with numpy, so it is converted once, not at each reader."""

    src: int
    dst: int
    costs: np.ndarray
    note: str = ""

    def __post_init__(self) -> None:
        self.costs = np.asarray(self.costs, dtype=float)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ProblemEdge) and (self.src, self.dst, self.note)
                == (other.src, other.dst, other.note)
                and np.array_equal(self.costs, other.costs))

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq


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
                           "costs": e.costs.tolist()}
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
        edges = [ProblemEdge(int(e["src"]), int(e["dst"]), np.asarray(e["costs"], dtype=float),
                             e.get("note", ""))
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


class IlpStatus(StrEnum):
    """How an intra-operator ILP ended: ``OPTIMAL`` (proven, or within the relative gap it was
    given), ``TIME_LIMIT`` (stopped at its limit with a plan: the better of it and the greedy
    plan), ``NO_SOLUTION`` (stopped with none: the greedy plan), ``SOLVER_ERROR`` (the solver
    failed: the greedy plan), ``TRIVIAL`` (one choice per node: nothing to solve),
    ``LEAST_MEMORY`` (the memory rows admit no plan but the memory model finds the least-memory
    plan within the budget: that plan, not the cheapest; ``solve_intra_op``)."""

    OPTIMAL = "optimal"
    TIME_LIMIT = "time_limit"
    NO_SOLUTION = "no_solution"
    SOLVER_ERROR = "solver_error"
    TRIVIAL = "trivial"
    LEAST_MEMORY = "least_memory"


# The endings that did not prove their plan: planners name them in the plan's notes.
STOPPED_STATUSES = frozenset({IlpStatus.TIME_LIMIT, IlpStatus.NO_SOLUTION,
                              IlpStatus.SOLVER_ERROR})


@dataclass
class IntraOpSolution:
    """A chosen strategy per node and how the solver got there."""

    choices: list[int]
    objective: float
    status: IlpStatus
    proven_optimal: bool
    gap: float | None
    # "highs" | "cbc" | "highs-lp" | "dual-ascent[+...]" | "presolve" or "elimination" (solved
    # exactly without a MIP) | "trivial"
    solver: str
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
    """No choice of strategies fits the per-device memory budget.

    ``min_peak_bytes``: the least memory a plan needs, or with ``split_over`` (a device count)
    a floor under it: the step with every tensor split as many ways as a mesh of that many
    devices (of ``mesh_shape``) can split it, which was over the budget before any ILP was
    built."""

    def __init__(self, budget: float, min_peak_bytes: float, dominant: str = "",
                 split_over: int | None = None, mesh_shape: tuple[int, ...] = ()):
        self.budget = budget
        self.min_peak_bytes = min_peak_bytes
        self.dominant = dominant
        self.split_over = split_over
        self.mesh_shape = tuple(mesh_shape)
        have, need = format_bytes(budget), format_bytes(min_peak_bytes)
        if have == need:  # rounding hid the difference: show exact bytes
            have, need = f"{budget:.0f} bytes", f"{min_peak_bytes:.0f} bytes"
        most = f", most of it {dominant}" if dominant else ""
        if split_over is not None:
            divide = (f" as far as its dimensions divide (mesh "
                      f"{'x'.join(map(str, self.mesh_shape))})," if self.mesh_shape else "")
            text = (f"no sharding plan fits in {have} per device; with every tensor split over "
                    f"all {split_over} devices{divide} the step still needs {need}{most}")
        else:
            text = (f"no sharding plan fits in {have} per device; the smallest per-device "
                    f"memory any plan needs is {need}{most}")
        super().__init__(text)


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
