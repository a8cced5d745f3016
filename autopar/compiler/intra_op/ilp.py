"""The intra-operator sharding ILP as plain data, its solution, and ``solve``.

Each node picks one strategy; an edge (u, v) costs ``costs[i][j]`` when u picks i and v picks j;
the objective is the sum of chosen node and edge costs, optionally under a per-device memory
budget over live sets. Nothing here knows about JAX: the builder in ``intra_op.py`` makes the
problem, ``solve`` answers it (exact presolve in ``presolve.py``, the MIP and its solvers
in ``mip.py``). The ``--dump-ilp`` JSON format is described in docs/ilp-format.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from autopar.compiler.intra_op.dual_bound import (
    DualBound,
    WarmMessages,
    reduced_objective,
    tighten,
)
from autopar.compiler.intra_op.elimination import solve_by_elimination
from autopar.compiler.intra_op.mip import (
    MIP_REL_GAP,
    build_mip,
    lp_rounding,
    resolve_auto,
    run_mip,
    solver_name,
)
from autopar.compiler.intra_op.presolve import ReducedProblem, complete_choices, local_search
from autopar.compiler.intra_op.presolve import presolve as reduce_problem
from autopar.compiler.intra_op.problem import (
    IlpStatus,
    InfeasibleMemoryError,
    IntraOpProblem,
    IntraOpSolution,
    ProblemEdge,
    ProblemNode,
)
from autopar.errors import AutoparError, InvalidOptionError
from autopar.methods import Solver

# A gap this loose or looser is first tried by rounding the LP relaxation (a proof when the
# rounded plan is within the gap of the LP's bound); tighter gaps go straight to the MIP.
LP_ROUNDING_MIN_GAP = 1e-4
WARM_START = True  # hand the greedy plan to the solver (a switch for measurements)
# Problems whose edges would pair more strategies than this are first bounded by dual ascent
# (``dual_bound``): past it the MIP's LP alone takes HiGHS seconds to minutes.
DUAL_BOUND_MIN_PAIRS = 20_000
# The share of the time limit dual ascent may spend before the MIP gets what it left.
DUAL_BOUND_TIME_SHARE = 0.5


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
        if not (0 <= e.src < n and 0 <= e.dst < n) or e.costs.shape != (
                sizes[e.src], sizes[e.dst]) or not np.isfinite(e.costs).all():
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
    return total + math.fsum(float(e.costs[choices[e.src], choices[e.dst]])
                             for e in problem.edges)


def peak_memory(problem: IntraOpProblem, choices: Sequence[int]) -> float:
    """Largest per-device memory over the live sets (each a set of nodes) for ``choices``."""
    _check_choices(problem, choices)
    mem = [0.0 if nd.memory is None else nd.memory[c]
           for nd, c in zip(problem.nodes, choices, strict=True)]
    return max((math.fsum(mem[u] for u in set(s)) for s in problem.live_sets), default=0.0)


def least_memory_choices(problem: IntraOpProblem) -> list[int]:
    """Every node at its least-memory strategy: the plan of least peak memory."""
    return [0 if nd.memory is None else int(np.argmin(nd.memory)) for nd in problem.nodes]


def min_peak_memory(problem: IntraOpProblem, *, solver: str = Solver.AUTO,
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
        total += e.costs[grid[e.src], grid[e.dst]]
    if problem.memory_budget is not None:
        for s in problem.live_sets:
            load = np.zeros(grid.shape[1])
            for u in set(s):
                if problem.nodes[u].memory is not None:
                    load += np.asarray(problem.nodes[u].memory)[grid[u]]
            total[load > problem.memory_budget] = np.inf
    best = int(np.argmin(total))
    if not np.isfinite(total[best]):
        assert problem.memory_budget is not None, "costs are finite (_check): only memory is inf"
        raise InfeasibleMemoryError(problem.memory_budget, min_peak_memory(problem))
    choices = [int(c) for c in grid[:, best]]
    return choices, evaluate(problem, choices)


def solve(problem: IntraOpProblem, *, solver: str = Solver.AUTO, time_limit_s: float = 30.0,
          presolve: bool = True, relative_gap: float = MIP_REL_GAP,
          start: Sequence[int] | None = None, dual_bound: bool = True,
          elimination: bool = True, warm: WarmMessages | None = None) -> IntraOpSolution:
    """Cheapest choices within the memory budget.

    The solver gets what is left of ``time_limit_s`` after presolve and model building (at least
    0.05 s); PuLP's hand-over to it and CBC's overshoot come on top (docs/ilp-format.md). On the
    limit, the better of the solver's incumbent and the greedy start plan comes back with status
    "time_limit"; when the solver stopped without a plan, the greedy plan with "no_solution";
    when it failed, the greedy plan with "solver_error" (``IlpStatus``). Raises
    ``InfeasibleMemoryError`` when no plan fits the budget.
    ``presolve=False`` keeps every node in the MIP (for tests and measurements).
    ``start``: a plan (a strategy per node) the answer must not be worse than, handed to the
    solver as its warm start when it is the best known.
    ``dual_bound``: a problem whose edges pair more than ``DUAL_BOUND_MIN_PAIRS`` strategies is
    first bounded by dual ascent (``dual_bound.tighten``): solved when its plan is within
    ``relative_gap`` of its bound, else the strategies no optimal plan takes are dropped and the
    MIP solves what is left (exact). False skips that (for tests and measurements).
    ``relative_gap``: the solver stops once its incumbent is within this fraction of its bound
    (default 1e-9: optimal up to solver tolerances; a looser gap "optimal" means within it).
    ``warm``: dual messages from a solve of a problem this one restricts, to start dual
    ascent from; what this solve's ascent ends with is kept there for the next.
    ``elimination``: a problem without memory rows whose presolved graph eliminates within
    the price ``elimination.solve_by_elimination`` allows (table entries: 5M, or 100 per
    edge pair) is solved exactly that way (solver "elimination"), before any of the above.
    False skips that (for tests of the other paths).
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
        return IntraOpSolution([0] * n, evaluate(problem, [0] * n), IlpStatus.TRIVIAL, True,
                               0.0, "trivial", 0, 0, time.perf_counter() - t0, 0.0)
    r = reduce_problem(problem, presolve)
    if not r.cost:  # presolve decided every node exactly
        choices = complete_choices(r, n, {})
        return IntraOpSolution(choices, evaluate(problem, choices), IlpStatus.OPTIMAL, True,
                               0.0, "presolve", 0, 0, time.perf_counter() - t0, 0.0)
    if elimination and presolve and (core := solve_by_elimination(r)) is not None:
        choices = complete_choices(r, n, core)
        if start is not None and evaluate(problem, start) < evaluate(problem, choices):
            choices = list(start)  # equally optimal, and cheaper by round-off
        return IntraOpSolution(choices, evaluate(problem, choices), IlpStatus.OPTIMAL, True,
                               0.0, "elimination", 0, 0, time.perf_counter() - t0, 0.0,
                               len(r.cost), sum(len(a) for a in r.adj.values()) // 2)
    if dual_bound and presolve and _pair_count(r) > DUAL_BOUND_MIN_PAIRS:
        return _solve_bounded(problem, r, solver=name, time_limit_s=time_limit_s,
                              relative_gap=relative_gap, started=t0, start=start, warm=warm)
    if name == Solver.AUTO:
        name = resolve_auto()
    # Greedy plans from the cheapest and from the least-memory choices (the latter always fits:
    # the budget was checked): the solver's warm start, and the answer if it finds no better.
    cheap = {u: int(np.argmin(c)) for u, c in r.cost.items()}
    lean = {**cheap, **{u: int(np.argmin(d)) for terms, _ in r.rows for u, d in terms}}
    given = None if start is None else local_search(r, {u: int(start[u]) for u in r.cost})
    greedy = [g for g in (local_search(r, cheap), local_search(r, lean) if r.rows else None,
                          given) if g is not None]
    plans = [complete_choices(r, n, g) for g in greedy]
    best = min(range(len(plans)), key=lambda i: evaluate(problem, plans[i]))
    model = build_mip(r, greedy[best] if WARM_START else None)
    if name == Solver.HIGHS and relative_gap >= LP_ROUNDING_MIN_GAP:
        # The LP relaxation is tight on these problems but fractional: its rounding, polished,
        # is often within the gap of the LP's bound, which proves it without a MIP search.
        bound, rounded = lp_rounding(model, max(time_limit_s - (time.perf_counter() - t0), 0.05))
        polished = local_search(r, rounded) if rounded else None
        if polished is not None:
            plan = complete_choices(r, n, polished)
            value, lower = evaluate(problem, plan), r.const + model.scale * bound
            if value - lower <= relative_gap * abs(value):
                t1 = time.perf_counter()
                return IntraOpSolution(
                    plan, value, IlpStatus.OPTIMAL, True,
                    max(0.0, value - lower) / abs(value) if value else 0.0, "highs-lp",
                    model.num_columns, model.num_rows, t1 - t0, 0.0, len(r.cost),
                    sum(len(a) for a in r.adj.values()) // 2)
            plans.append(plan)
    t1 = time.perf_counter()
    result = run_mip(model, name, max(time_limit_s - (t1 - t0), 0.05), relative_gap)
    t2 = time.perf_counter()
    if result.status in (IlpStatus.OPTIMAL, IlpStatus.TIME_LIMIT):
        plans.append(complete_choices(r, n, result.core))
    plans = [p for p in plans if budget is None or peak_memory(problem, p) <= budget * (1 + 1e-9)]
    if not plans:  # unreachable while the least-memory plan fits; kept as a guard
        raise AutoparError(f"the ILP solver found no plan within time_limit_s={time_limit_s:g}; "
                           "raise the time limit")
    choices = min(plans, key=lambda p: evaluate(problem, p))
    optimal = result.status == IlpStatus.OPTIMAL
    objective, gap = evaluate(problem, choices), (0.0 if optimal else None)
    if result.bound is not None and objective:  # in original units: constant + scaled MIP's
        gap = max(0.0, objective - (r.const + model.scale * result.bound)) / abs(objective)
    return IntraOpSolution(
        choices, objective, result.status, optimal, gap, name,
        model.num_columns, model.num_rows, t1 - t0, t2 - t1, len(r.cost),
        sum(len(a) for a in r.adj.values()) // 2)


# ---------------------------------------------------------------- large problems -----------

def _pair_count(r: ReducedProblem) -> int:
    """Pair variables the MIP's edges would have before grouping equal rows and columns."""
    return sum(len(r.cost[u]) * len(r.cost[w]) for u, nbrs in r.adj.items() for w in nbrs
               if w > u)


def restrict(problem: IntraOpProblem,
             keep: dict[int, np.ndarray]) -> tuple[IntraOpProblem, list[np.ndarray]]:
    """``problem`` with node u's strategies cut to ``keep[u]`` (ascending indices; every
    strategy of a node not in ``keep``), and per node the original index of each strategy
    left."""
    kept = [np.asarray(keep[u]) if u in keep else np.arange(len(nd.costs))
            for u, nd in enumerate(problem.nodes)]
    nodes = [ProblemNode(nd.name, [nd.costs[i] for i in s], [nd.strategy_names[i] for i in s],
                         None if nd.memory is None else [nd.memory[i] for i in s], nd.follow_note)
             for nd, s in zip(problem.nodes, kept, strict=True)]
    edges = [ProblemEdge(e.src, e.dst, e.costs[np.ix_(kept[e.src], kept[e.dst])], e.note)
             for e in problem.edges]
    return IntraOpProblem(nodes, edges, problem.memory_budget, problem.live_sets), kept


def _bound_seed(r: ReducedProblem, start: Sequence[int] | None) -> dict[int, int] | None:
    """The best greedy plan to start dual ascent from: from the cheapest choices, from the
    least-memory ones where memory rows exist, and from ``start``."""
    cheap = {u: int(np.argmin(c)) for u, c in r.cost.items()}
    seeds = [cheap]
    if r.rows:
        seeds.append({**cheap, **{u: int(np.argmin(d)) for terms, _ in r.rows for u, d in terms}})
    if start is not None:
        seeds.append({u: int(start[u]) for u in r.cost})
    plans = [p for p in (local_search(r, s) for s in seeds) if p is not None]
    return min(plans, key=lambda p: reduced_objective(r, p)) if plans else None


def _kept(bound: DualBound) -> int:
    return sum(len(k) for k in bound.keep.values())


def _solve_bounded(problem: IntraOpProblem, r: ReducedProblem, *, solver: str,
                   time_limit_s: float, relative_gap: float, started: float,
                   start: Sequence[int] | None,
                   warm: WarmMessages | None = None) -> IntraOpSolution:
    """``solve`` for large problems: dual ascent first (``DUAL_BOUND_TIME_SHARE`` of the time
    limit at most); its plan when within ``relative_gap`` of its bound, else the MIP on the
    strategies the bound leaves (the optimum is among them), warm-started with that plan."""
    n = len(problem.nodes)
    edges = sum(len(a) for a in r.adj.values()) // 2
    deadline = started + DUAL_BOUND_TIME_SHARE * time_limit_s
    seed = _bound_seed(r, start)
    warm_start = None if warm is None else warm.start(r)
    bound: DualBound = tighten(r, relative_gap=relative_gap, deadline=deadline, start=seed,
                               warm=warm_start)
    if warm_start and bound.gap() > relative_gap:
        # started from a less split variant's messages, the ascent can stall with its decoded
        # plans far from the optimum its bound allows (GPT 15B's ILP on one mesh: 35 sweeps,
        # plan 2.7% over the bound, 1,277 of 1,638 strategies kept and HiGHS 6 s on them;
        # from zero, 135 sweeps, 0.34%, 755 kept, HiGHS 2.8 s): the cold ascent is run too
        # and the one keeping fewer strategies goes on
        cold = tighten(r, relative_gap=relative_gap, deadline=deadline, start=seed)
        if _kept(cold) < _kept(bound):
            bound = cold
    if warm is not None:
        warm.keep(r, bound.messages)
    if bound.plan is not None and bound.gap() <= relative_gap:
        choices = complete_choices(r, n, bound.plan)
        return IntraOpSolution(choices, evaluate(problem, choices), IlpStatus.OPTIMAL, True,
                               bound.gap(), "dual-ascent", 0, 0,
                               time.perf_counter() - started, 0.0, len(r.cost), edges)
    restricted, kept = restrict(problem, bound.keep)
    sub_start = None
    if bound.plan is not None:
        full = complete_choices(r, n, bound.plan)
        sub_start = [int(np.searchsorted(kept[u], full[u])) for u in range(n)]
    remaining = max(time_limit_s - (time.perf_counter() - started), 0.05)
    sub = solve(restricted, solver=solver, time_limit_s=remaining, relative_gap=relative_gap,
                start=sub_start, dual_bound=False)
    choices = [int(kept[u][c]) for u, c in enumerate(sub.choices)]
    value = evaluate(problem, choices)
    gap = sub.gap
    if not sub.proven_optimal and value:  # the dual bound holds for the whole problem
        dual_gap = max(0.0, value - bound.lower) / abs(value)
        gap = dual_gap if gap is None else min(gap, dual_gap)
    return dataclasses.replace(
        sub, choices=choices, objective=value, gap=gap, solver=f"dual-ascent+{sub.solver}",
        build_time_s=time.perf_counter() - started - sub.solve_time_s)
