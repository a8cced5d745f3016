"""The intra-operator sharding ILP as plain data, its exact presolve, and its solution.

Each node picks one strategy; an edge (u, v) costs ``costs[i][j]`` when u picks i and v picks j;
the objective is the sum of chosen node and edge costs, optionally under a per-device memory
budget over live sets. Nothing here knows about JAX: the builder in ``intra_op.py`` makes the
problem, ``solve`` answers it. The ``--dump-ilp`` JSON format is described in docs/ilp-format.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pulp

from autopar.errors import AutoparError, InvalidOptionError, PlanError, choices_text

FORMAT_VERSION = 1
SOLVERS = ("auto", "highs", "cbc")
# HiGHS's default relative gap (1e-4) stops at measurably worse plans; at 1e-9 the solvers'
# integrality/feasibility tolerances (~1e-6) are what limit "optimal" (docs/ilp-format.md).
MIP_REL_GAP = 1e-9
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

    def __init__(self, budget: float, min_peak_bytes: float):
        self.budget = budget
        self.min_peak_bytes = min_peak_bytes
        have, need = _fmt_bytes(budget), _fmt_bytes(min_peak_bytes)
        if have == need:  # rounding hid the difference: show exact bytes
            have, need = f"{budget:.0f} bytes", f"{min_peak_bytes:.0f} bytes"
        super().__init__(f"no sharding plan fits in {have} per device; the smallest per-device "
                         f"memory any plan needs is {need}")


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


def _min_memory(problem: IntraOpProblem) -> list[int]:
    return [0 if nd.memory is None else int(np.argmin(nd.memory)) for nd in problem.nodes]


def min_peak_memory(problem: IntraOpProblem, *, solver: str = "auto",
                    time_limit_s: float = 30.0) -> float:
    """Smallest peak memory any plan has. Exact and solver-free: every live-set sum grows with
    each node's own memory, so each node at its least-memory strategy minimises all of them at
    once. ``solver``/``time_limit_s`` are only checked, for a uniform signature."""
    _solver_name(solver)
    return peak_memory(problem, _min_memory(problem))


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


# ---------------------------------------------------------------- exact presolve ------------

@dataclass
class _Reduced:
    """What the MIP still decides after presolve, and how to recover everything else."""

    cost: dict[int, np.ndarray] = field(default_factory=dict)  # free node -> cost vector
    adj: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # adj[u][w]: [ku][kw]
    fixed: dict[int, int] = field(default_factory=dict)
    # Eliminated nodes in order: (node, its cost then, [(neighbour, matrix [k_node][k_nbr])]).
    trail: list[tuple[int, np.ndarray, list[tuple[int, np.ndarray]]]] = field(default_factory=list)
    rows: list[tuple[list[tuple[int, np.ndarray]], float]] = field(default_factory=list)
    const: float = 0.0

    def add_edge(self, u: int, w: int, m: np.ndarray, fold: bool) -> None:
        """Add ``m`` to edge (u, w); with ``fold``, an edge whose matrix is a_i + b_j (all-zero
        and constant ones included) moves into the two node costs and disappears."""
        if w in self.adj[u]:
            m = self.adj[u][w] + m
        a, b = m[:, 0], m[0, :] - m[0, 0]
        if fold and np.allclose(m, a[:, None] + b[None, :], rtol=0,
                                atol=1e-12 * max(1.0, float(np.abs(m).max()))):
            self.cost[u] = self.cost[u] + a
            self.cost[w] = self.cost[w] + b
            self.adj[u].pop(w, None)
            self.adj[w].pop(u, None)
        else:
            self.adj[u][w], self.adj[w][u] = m, m.T


def _presolve(problem: IntraOpProblem, exact_reductions: bool) -> _Reduced:
    """Fold single-strategy nodes into neighbours, sum parallel edges, drop separable edges,
    reduce memory rows, then eliminate free degree-0/1/2 nodes by min-plus products (exact
    variable elimination; it turns chains and trees into nothing). Without
    ``exact_reductions`` only parallel edges and self-loops are merged (to test the raw MIP)."""
    r = _Reduced()
    for u, nd in enumerate(problem.nodes):
        if exact_reductions and len(nd.costs) == 1:
            r.fixed[u] = 0
            r.const += nd.costs[0]
        else:
            r.cost[u], r.adj[u] = np.asarray(nd.costs, float), {}
    for e in problem.edges:
        m, u, w = np.asarray(e.costs, float), e.src, e.dst
        if u == w and u not in r.fixed:  # a self-loop pays its diagonal
            r.cost[u] = r.cost[u] + np.diagonal(m)
        elif u in r.fixed and w in r.fixed:
            r.const += m[0, 0]
        elif u in r.fixed:
            r.cost[w] = r.cost[w] + m[0, :]
        elif w in r.fixed:
            r.cost[u] = r.cost[u] + m[:, 0]
        else:
            r.add_edge(u, w, m, exact_reductions)
    if problem.memory_budget is not None:
        rows: dict[tuple[int, ...], tuple[list[tuple[int, np.ndarray]], float]] = {}
        for live in {frozenset(s) for s in problem.live_sets}:
            rhs, terms = float(problem.memory_budget), []
            for u in sorted(live):
                if problem.nodes[u].memory is None:
                    continue
                mem = np.asarray(problem.nodes[u].memory, float)
                if not exact_reductions:
                    terms.append((u, mem))
                    continue
                # Each node's least memory is spent whatever it picks: move it to the right side,
                # so nodes whose memory does not depend on their choice leave the row.
                rhs -= mem.min()
                if u in r.cost and np.ptp(mem) > 0:
                    terms.append((u, mem - mem.min()))
            if exact_reductions:
                rhs = max(rhs, 0.0)  # >= 0 up to round-off: feasibility was checked before
                if sum(d.max() for _, d in terms) <= rhs:
                    continue  # no choice can break this row
            key = tuple(u for u, _ in terms)
            if key and (key not in rows or rhs < rows[key][1]):
                rows[key] = (terms, rhs)
        r.rows = list(rows.values())
    if exact_reductions:
        _eliminate(r, {u for terms, _ in r.rows for u, _ in terms})
    return r


def _eliminate(r: _Reduced, pinned: set[int]) -> None:
    queue = [u for u in r.cost if u not in pinned and len(r.adj[u]) <= 2]
    while queue:
        u = queue.pop()
        if u not in r.cost or u in pinned or len(r.adj[u]) > 2:
            continue
        c = r.cost.pop(u)
        nbrs = list(r.adj.pop(u).items())
        for w, _ in nbrs:
            del r.adj[w][u]
        if not nbrs:
            r.const += float(c.min())
        elif len(nbrs) == 1:  # leaf: its neighbour pays the leaf's best answer to each choice
            (w, m), = nbrs
            r.cost[w] = r.cost[w] + (c[:, None] + m).min(axis=0)
        else:  # chain link: a new edge a-b pays min over u's strategies
            (a, ma), (b, mb) = nbrs
            r.add_edge(a, b, (ma.T[:, :, None] + c[None, :, None] + mb[None, :, :]).min(axis=1),
                       True)
        r.trail.append((u, c, nbrs))
        queue.extend(w for w, _ in nbrs)


def _complete(r: _Reduced, n: int, core: dict[int, int]) -> list[int]:
    """Full choices from the MIP's: eliminated nodes answer their neighbours, last first."""
    ch = {**r.fixed, **core}
    for u, c, nbrs in reversed(r.trail):
        ch[u] = int(np.argmin(c + sum((m[:, ch[w]] for w, m in nbrs), np.zeros_like(c))))
    return [ch[u] for u in range(n)]


def _local_search(r: _Reduced, start: dict[int, int], sweeps: int = 8) -> dict[int, int] | None:
    """Greedy single-node moves from ``start`` that keep every memory row satisfied: the
    fallback plan when the solver stops without one. None when ``start`` breaks a row."""
    ch = dict(start)
    load = [sum(d[ch[u]] for u, d in terms) for terms, _ in r.rows]
    if any(ld > rhs * (1 + 1e-9) for ld, (_, rhs) in zip(load, r.rows, strict=True)):
        return None
    rows_of: dict[int, list[tuple[int, np.ndarray]]] = {u: [] for u in r.cost}
    for k, (terms, _) in enumerate(r.rows):
        for u, d in terms:
            rows_of[u].append((k, d))
    for _ in range(sweeps):
        moved = False
        for u, c in r.cost.items():
            v = c + sum((m[:, ch[w]] for w, m in r.adj[u].items()), np.zeros_like(c))
            for i in map(int, np.argsort(v, kind="stable")):
                if v[i] >= v[ch[u]] - 1e-12 * abs(v[ch[u]]):
                    break
                if all(load[k] - d[ch[u]] + d[i] <= r.rows[k][1] for k, d in rows_of[u]):
                    for k, d in rows_of[u]:
                        load[k] += d[i] - d[ch[u]]
                    ch[u], moved = i, True
                    break
        if not moved:
            break
    return ch


# ---------------------------------------------------------------- MIP -----------------------

def _solver_name(solver: str) -> str:
    if solver not in SOLVERS:
        raise InvalidOptionError(f"unknown ILP solver {solver!r}; valid: {choices_text(SOLVERS)}")
    if solver != "auto" and not _available(solver):
        raise InvalidOptionError(f"ILP solver {solver!r} is not installed (highs needs highspy, "
                                 "cbc PuLP's bundled binary); valid: auto")
    return solver


def _available(solver: str) -> bool:
    if solver == "highs":
        return bool(pulp.HiGHS().available())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(pulp.PULP_CBC_CMD().available())


def _groups(m: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Group of each row (rows equal bit for bit) and each group's first row; a dict of row
    bytes is ~50x faster than ``np.unique(axis=0)`` on these small matrices."""
    ids: dict[bytes, int] = {}
    of, reps = [], []
    for i, row in enumerate(m + 0.0):  # + 0.0 turns -0.0 into 0.0
        of.append(ids.setdefault(row.tobytes(), len(ids)))
        if of[-1] == len(reps):
            reps.append(i)
    return np.array(of), reps


def _build(r: _Reduced, start: dict[int, int] | None
           ) -> tuple[pulp.LpProblem, dict[int, list[pulp.LpVariable]], float]:
    """One-hot binaries per node; per edge, continuous pair variables whose row and column
    sums equal the two one-hots (exact: a one-hot row/column forces the pair to be one-hot)."""
    scale = max([float(np.abs(c).max()) for c in r.cost.values()]
                + [float(np.abs(m).max()) for a in r.adj.values() for m in a.values()])
    scale = scale or 1.0  # objective scaled to O(1) entries: solver tolerances are absolute
    prob = pulp.LpProblem("autopar_intra_op", pulp.LpMinimize)
    # PuLP 3.3 deprecates free-standing LpVariable for prob.add_variable (PuLP 4.0's only way).
    var = getattr(prob, "add_variable", pulp.LpVariable)
    s = {u: [var(f"s_{u}_{i}", cat=pulp.LpBinary) for i in range(len(c))]
         for u, c in r.cost.items()}
    obj = [(x, c[i] / scale) for u, c in r.cost.items() for i, x in enumerate(s[u]) if c[i]]
    for u, xs in s.items():
        prob += pulp.LpAffineExpression([(x, 1) for x in xs]) == 1
        for i, x in enumerate(xs):
            x.setInitialValue(float(start is not None and start[u] == i))
    for u, nbrs in r.adj.items():
        for w, m in nbrs.items():
            if w < u:
                continue
            # Strategies whose rows (columns) of the matrix are equal cost the same against
            # every choice of the other end: one pair variable serves the whole group. Exact:
            # a group's one-hot sum is 0 or 1, so the pair variables are still forced one-hot.
            # Resharding matrices depend only on the tensor's spec, so groups are large.
            row_of, rep_rows = _groups(m)
            col_of, rep_cols = _groups(m[rep_rows].T)
            g = m[np.ix_(rep_rows, rep_cols)]
            e = [[var(f"e_{u}_{w}_{a}_{b}", lowBound=0) for b in range(g.shape[1])]
                 for a in range(g.shape[0])]
            for a, row in enumerate(e):
                for b, x in enumerate(row):
                    x.setInitialValue(float(start is not None and row_of[start[u]] == a
                                            and col_of[start[w]] == b))
            obj += [(e[a][b], g[a, b] / scale) for a, b in zip(*np.nonzero(g), strict=True)]
            for a, row in enumerate(e):
                members = [(s[u][i], -1) for i in np.flatnonzero(row_of == a)]
                prob += pulp.LpAffineExpression([(x, 1) for x in row] + members) == 0
            # The last column group is implied by the rows and the other columns: leave it out.
            for b in range(g.shape[1] - 1):
                members = [(s[w][j], -1) for j in np.flatnonzero(col_of == b)]
                prob += pulp.LpAffineExpression([(row[b], 1) for row in e] + members) == 0
    for terms, rhs in r.rows:
        rs = max(float(d.max()) for _, d in terms) or 1.0  # memory rows scaled to O(1) too
        prob += pulp.LpAffineExpression(
            [(s[u][i], d[i] / rs) for u, d in terms for i in range(len(d)) if d[i]]) <= rhs / rs
    prob.setObjective(pulp.LpAffineExpression(obj))
    return prob, s, scale


class _HiGHS(pulp.HiGHS):  # type: ignore[misc]
    """PuLP's highspy interface plus a warm start from the variables' initial values (PuLP 3.3
    has none for it)."""

    def callSolver(self, lp: pulp.LpProblem) -> None:
        values = [v.varValue for v in lp.variables()]  # in column order: see buildSolverModel
        if WARM_START and values and None not in values:
            import highspy

            start = highspy.HighsSolution()
            start.col_value = values
            start.value_valid = True
            lp.solverModel.setSolution(start)
        lp.solverModel.run()


def _run(prob: pulp.LpProblem, name: str, limit: float) -> tuple[str, float | None]:
    """Solve; returns ("optimal" | "feasible" | "none", the solver's lower bound or None)."""
    if name == "highs":
        try:
            prob.solve(_HiGHS(msg=False, timeLimit=limit, gapRel=MIP_REL_GAP))
        except (pulp.PulpSolverError, IndexError):  # no solution vector to read back
            return "none", None
        h = prob.solverModel
        info, optimal = h.getInfo(), h.getModelStatus() == h.getModelStatus().kOptimal
        has = info.primal_solution_status == 2  # kSolutionStatusFeasible
        bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
        return ("optimal" if optimal and has else "feasible" if has else "none"), bound
    fd, log = tempfile.mkstemp(suffix=".log", prefix="autopar-cbc-")
    os.close(fd)
    try:
        with warnings.catch_warnings():  # PuLP 3.3: "PULP_CBC_CMD is deprecated" (bundled CBC)
            warnings.simplefilter("ignore", DeprecationWarning)
            cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, gapRel=MIP_REL_GAP, logPath=log,
                                    warmStart=WARM_START)
        prob.solve(cbc)
        with open(log) as f:
            text = f.read()
    except pulp.PulpSolverError:
        return "none", None
    finally:
        os.unlink(log)
    # CBC's summary says "Lower bound: x" on time limit, nothing when optimal.
    found = re.search(r"^Lower bound:\s*(\S+)", text, re.M)
    bound = float(found.group(1)) if found else None
    status = {pulp.LpSolutionOptimal: "optimal",
              pulp.LpSolutionIntegerFeasible: "feasible"}.get(prob.sol_status, "none")
    return status, bound


def solve(problem: IntraOpProblem, *, solver: str = "auto", time_limit_s: float = 30.0,
          presolve: bool = True) -> IntraOpSolution:
    """Cheapest choices within the memory budget.

    The solver gets what is left of ``time_limit_s`` after presolve and model building (at least
    0.05 s); PuLP's hand-over to it and CBC's overshoot come on top (docs/ilp-format.md). On the
    limit, the better of the solver's incumbent and the greedy start plan comes back with status
    "time_limit". Raises ``InfeasibleMemoryError`` when no plan fits the budget.
    ``presolve=False`` keeps every node in the MIP (for tests and measurements).
    """
    t0 = time.perf_counter()
    name = _solver_name(solver)
    if not time_limit_s > 0:
        raise InvalidOptionError(f"time_limit_s must be positive, got {time_limit_s}")
    _check(problem)
    n, budget = len(problem.nodes), problem.memory_budget
    if budget is not None and (need := min_peak_memory(problem)) > budget:
        raise InfeasibleMemoryError(budget, need)
    if all(len(nd.costs) == 1 for nd in problem.nodes):
        return IntraOpSolution([0] * n, evaluate(problem, [0] * n), "trivial", True, 0.0,
                               "trivial", 0, 0, time.perf_counter() - t0, 0.0)
    r = _presolve(problem, presolve)
    if not r.cost:  # presolve decided every node exactly
        choices = _complete(r, n, {})
        return IntraOpSolution(choices, evaluate(problem, choices), "optimal", True, 0.0,
                               "presolve", 0, 0, time.perf_counter() - t0, 0.0)
    if name == "auto":  # neither was consistently faster at any size measured: prefer HiGHS,
        name = "highs" if _available("highs") else "cbc"  # which keeps to its time limit
    # Greedy plans from the cheapest and from the least-memory choices (the latter always fits:
    # the budget was checked): the solver's warm start, and the answer if it finds no better.
    cheap = {u: int(np.argmin(c)) for u, c in r.cost.items()}
    lean = {**cheap, **{u: int(np.argmin(d)) for terms, _ in r.rows for u, d in terms}}
    greedy = [g for g in (_local_search(r, cheap), _local_search(r, lean) if r.rows else None)
              if g is not None]
    plans = [_complete(r, n, g) for g in greedy]
    best = min(range(len(plans)), key=lambda i: evaluate(problem, plans[i]))
    prob, s, scale = _build(r, greedy[best] if WARM_START else None)
    t1 = time.perf_counter()
    status, bound = _run(prob, name, max(time_limit_s - (t1 - t0), 0.05))
    t2 = time.perf_counter()
    if status != "none":
        core = {u: int(np.argmax([x.varValue or 0.0 for x in xs])) for u, xs in s.items()}
        plans.append(_complete(r, n, core))
    plans = [p for p in plans if budget is None or peak_memory(problem, p) <= budget * (1 + 1e-9)]
    if not plans:  # unreachable while the least-memory plan fits; kept as a guard
        raise AutoparError(f"the ILP solver found no plan within time_limit_s={time_limit_s:g}; "
                           "raise the time limit")
    choices = min(plans, key=lambda p: evaluate(problem, p))
    objective, gap = evaluate(problem, choices), (0.0 if status == "optimal" else None)
    if bound is not None and objective:  # the bound in original units: constant + scaled MIP's
        gap = max(0.0, objective - (r.const + scale * bound)) / abs(objective)
    return IntraOpSolution(
        choices, objective, "optimal" if status == "optimal" else "time_limit",
        status == "optimal", gap, name, prob.numVariables(), prob.numConstraints(), t1 - t0,
        t2 - t1, len(r.cost), sum(len(a) for a in r.adj.values()) // 2)
