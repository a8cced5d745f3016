"""The intra-operator ILP core: exactness against brute force, presolve, memory, limits, JSON."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from ilp_problems import random_problem, spec_problem

from autopar.compiler.intra_op.ilp import brute_force, evaluate, min_peak_memory, peak_memory, solve
from autopar.compiler.intra_op.mip import build_mip, run_mip
from autopar.compiler.intra_op.presolve import complete_choices, local_search
from autopar.compiler.intra_op.presolve import presolve as reduce_problem
from autopar.compiler.intra_op.problem import (
    InfeasibleMemoryError,
    IntraOpProblem,
    IntraOpSolution,
    ProblemEdge,
    ProblemNode,
    problem_to_json,
)
from autopar.errors import AutoparError, InvalidOptionError, PlanError

SOLVERS = ["highs", "cbc"]


def enumerate_min_peak(problem: IntraOpProblem) -> float:
    """Minimum peak memory by plain enumeration (independent of the library's shortcut)."""
    ranges = [range(len(nd.costs)) for nd in problem.nodes]
    return min(peak_memory(problem, ch) for ch in itertools.product(*ranges))


def assert_same(a: float, b: float) -> None:
    assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (a, b)


def with_budget(problem: IntraOpProblem, where: str) -> IntraOpProblem:
    """Set a budget: "tight" between the least peak and the cost-optimal plan's peak."""
    best, _ = brute_force(problem)
    hi, lo = peak_memory(problem, best), enumerate_min_peak(problem)
    problem.memory_budget = {"tight": (hi + lo) / 2, "loose": hi, "least": lo}[where]
    return problem


@pytest.mark.parametrize("presolve", [True, False])
@pytest.mark.parametrize("solver", SOLVERS)
def test_matches_brute_force(solver: str, presolve: bool) -> None:
    # solve() end to end: on these instances presolve or the greedy plan usually has the
    # optimum already; test_mip_matches_brute_force_where_greedy_is_not checks the MIP itself.
    for seed in range(16):
        problem = random_problem(seed, memory=seed % 2 == 1)
        if problem.live_sets:
            with_budget(problem, ("tight", "loose", "least")[seed % 3])
        want_choices, want = brute_force(problem)
        got = solve(problem, solver=solver, presolve=presolve)
        assert_same(got.objective, want)
        assert got.objective == evaluate(problem, got.choices)
        assert got.status in ("optimal", "trivial") and got.proven_optimal
        if problem.memory_budget is not None:
            assert peak_memory(problem, got.choices) <= problem.memory_budget


def greedy_plans(problem: IntraOpProblem, r) -> list[dict[int, int]]:
    """solve()'s greedy plans: local search from the cheapest and (with memory rows) from the
    least-memory choices."""
    cheap = {u: int(np.argmin(c)) for u, c in r.cost.items()}
    lean = {**cheap, **{u: int(np.argmin(d)) for terms, _ in r.rows for u, d in terms}}
    return [g for g in (local_search(r, cheap), local_search(r, lean) if r.rows else None)
            if g is not None]


@pytest.fixture(scope="module")
def greedy_is_not_optimal() -> list[tuple[IntraOpProblem, float, dict[int, int]]]:
    """Random instances (half under a memory budget) where the best greedy plan is worse than
    brute force: (problem, optimum, best greedy plan), from a fixed range of seeds."""
    found = []
    for seed in range(80):
        problem = random_problem(seed, n=7, kmin=2, kmax=4, p_edge=0.6, memory=seed % 2 == 1)
        if problem.live_sets:
            with_budget(problem, ("tight", "loose", "least")[seed % 3])
        _, want = brute_force(problem)
        r = reduce_problem(problem, False)
        n = len(problem.nodes)
        greedy = min(greedy_plans(problem, r),
                     key=lambda g: evaluate(problem, complete_choices(r, n, g)))
        if evaluate(problem, complete_choices(r, n, greedy)) > want + 1e-9 * max(1.0, want):
            found.append((problem, want, greedy))
    return found


@pytest.mark.parametrize("solver", SOLVERS)
def test_mip_matches_brute_force_where_greedy_is_not(solver: str, greedy_is_not_optimal) -> None:
    """The MIP itself (no presolve, no greedy fallback: run_mip's answer alone), cold and
    warm-started from the suboptimal greedy plan, finds the brute-force optimum."""
    checked = 0
    for problem, want, greedy in greedy_is_not_optimal:
        r = reduce_problem(problem, False)  # presolve=False: every node stays in the MIP
        assert len(r.cost) == len(problem.nodes)
        for start in (None, greedy):
            result = run_mip(build_mip(r, start), solver, time_limit_s=30.0)
            assert result.status == "optimal"
            choices = complete_choices(r, len(problem.nodes), result.core)
            assert_same(evaluate(problem, choices), want)
            if problem.memory_budget is not None:
                assert peak_memory(problem, choices) <= problem.memory_budget * (1 + 1e-9)
        checked += 1
    assert checked >= 20  # the generator must keep producing instances greedy gets wrong


def test_a_looser_gap_holds_its_promise() -> None:
    """With a 1e-3 gap HiGHS first rounds the LP relaxation; whatever path answers, the plan is
    within 1e-3 of the true optimum and fits the budget."""
    answered_by_lp = 0
    for seed in range(12):
        problem = random_problem(seed, n=7, memory=seed % 2 == 1)
        if problem.live_sets:
            with_budget(problem, ("tight", "loose", "least")[seed % 3])
        _, want = brute_force(problem)
        got = solve(problem, solver="highs", relative_gap=1e-3, elimination=False)
        assert want <= got.objective <= want + 1e-3 * abs(got.objective) + 1e-12
        assert got.gap is not None and got.gap <= 1e-3
        if problem.memory_budget is not None:
            assert peak_memory(problem, got.choices) <= problem.memory_budget
        answered_by_lp += got.solver == "highs-lp"
    big = spec_problem(2, 120, 6)  # a problem presolve cannot finish: the MIP path or the LP's
    got = solve(big, solver="highs", relative_gap=1e-3, elimination=False)
    exact = solve(big, solver="highs", elimination=False)
    assert exact.objective <= got.objective <= exact.objective * (1 + 1e-3) + 1e-12
    answered_by_lp += got.solver == "highs-lp"
    assert answered_by_lp > 0  # the shortcut is exercised, not just present


@pytest.mark.parametrize("solver", SOLVERS)
def test_grouped_pair_variables_are_exact(solver: str) -> None:
    # Spec-derived matrices repeat rows and columns (strategies sharing an output or input
    # spec), so the MIP groups their pair variables; the optimum must not move.
    for seed in range(8):
        problem = spec_problem(seed, 6, 4)
        for e in problem.edges[::3]:  # and some strategies' memory, under a tight budget
            problem.nodes[e.dst].memory = [float(1 + (i * seed) % 3) for i in range(4)]
        problem.live_sets = [[e.src, e.dst] for e in problem.edges[::3]]
        with_budget(problem, "tight")
        got = solve(problem, solver=solver, presolve=False)
        assert_same(got.objective, brute_force(problem)[1])


def test_presolve_folds_constants_zero_and_parallel_edges() -> None:
    nodes = [
        ProblemNode("a", [1.0, 2.0, 0.5], ["R", "S0", "S1"]),
        ProblemNode("const", [0.25], ["R"]),
        ProblemNode("b", [0.3, 0.1], ["R", "S0"]),
        ProblemNode("c", [0.0, 0.7, 0.2], ["R", "S0", "S1"]),
        ProblemNode("d", [0.4, 0.4], ["R", "S0"]),
    ]
    edges = [
        ProblemEdge(1, 0, [[0.0, 3.0, 0.1]]),  # from a single-strategy node: a row
        ProblemEdge(0, 2, [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),  # all zero: dropped
        ProblemEdge(0, 2, [[0.0, 1.0], [1.0, 0.0], [2.0, 0.5]]),  # parallel to the zero edge
        ProblemEdge(2, 0, [[0.5, 0.0, 0.0], [0.0, 0.5, 0.2]]),  # parallel, other direction
        ProblemEdge(2, 3, [[1.0, 2.0, 3.0], [1.5, 2.5, 3.5]]),  # separable a_i + b_j: dropped
        ProblemEdge(3, 3, [[0.0, 9.0, 9.0], [9.0, 2.0, 9.0], [9.0, 9.0, 0.3]]),  # self-loop
        ProblemEdge(0, 4, [[0.0, 1.0], [1.0, 0.0], [0.2, 0.2]]),
        ProblemEdge(2, 4, [[0.0, 0.6], [0.6, 0.0]]),
        ProblemEdge(3, 4, [[0.0, 0.1], [0.1, 0.0], [0.3, 0.3]]),
    ]
    problem = IntraOpProblem(nodes, edges)
    _, want = brute_force(problem)
    for solver in SOLVERS:
        for presolve in (True, False):
            got = solve(problem, solver=solver, presolve=presolve)
            assert_same(got.objective, want)
    reduced = solve(problem, presolve=True)
    assert reduced.solver == "presolve" and reduced.num_variables == 0  # eliminated exactly


def test_elimination_of_trees_and_chains_is_exact() -> None:
    rng = np.random.default_rng(0)
    for seed in range(4):
        n = 11
        parents = [None] + [int(rng.integers(0, v)) if seed % 2 else v - 1 for v in range(1, n)]
        nodes = [ProblemNode(f"op{u}", list(rng.uniform(0, 1, 3)), ["a", "b", "c"])
                 for u in range(n)]
        edges = [ProblemEdge(p, v, rng.uniform(0, 1, (3, 3)).tolist())
                 for v, p in enumerate(parents) if p is not None]
        problem = IntraOpProblem(nodes, edges)
        got = solve(problem)
        assert got.solver == "presolve" and got.status == "optimal" and got.gap == 0.0
        assert_same(got.objective, brute_force(problem)[1])


def test_memory_budget_changes_choice() -> None:
    # The cheap strategies are the memory-hungry ones; only one of the two nodes may be cheap.
    nodes = [ProblemNode("x", [1.0, 3.0], ["R", "S"], [8.0, 2.0]),
             ProblemNode("y", [1.0, 2.0], ["R", "S"], [8.0, 2.0])]
    edges = [ProblemEdge(0, 1, [[0.0, 0.5], [0.5, 0.0]])]
    problem = IntraOpProblem(nodes, edges, memory_budget=10.0, live_sets=[[0, 1]])
    for solver in SOLVERS:
        got = solve(problem, solver=solver)
        assert got.choices == [0, 1] and got.objective == 3.5
        assert got.choices == brute_force(problem)[0]
    problem.memory_budget = None
    assert solve(problem).choices == [0, 0]


@pytest.mark.parametrize("solver", SOLVERS)
def test_impossible_budget_reports_least_peak(solver: str) -> None:
    for seed in range(1, 12, 2):
        problem = random_problem(seed, memory=True)
        least = enumerate_min_peak(problem)
        assert min_peak_memory(problem) == least
        problem.memory_budget = least - 0.5
        with pytest.raises(InfeasibleMemoryError) as info:
            solve(problem, solver=solver)
        assert info.value.min_peak_bytes == least
        assert isinstance(info.value, AutoparError)


def test_infeasible_message_names_both_sizes() -> None:
    gib = 2.0**30
    problem = IntraOpProblem([ProblemNode("w", [0.0, 1.0], ["R", "S"], [2 * gib, 1.37 * gib])],
                             [], memory_budget=gib, live_sets=[[0]])
    with pytest.raises(InfeasibleMemoryError, match=r"no sharding plan fits in 1\.00 GiB per "
                       r"device; the smallest per-device memory any plan needs is 1\.37 GiB$"):
        solve(problem)


@pytest.mark.parametrize("solver", SOLVERS)
def test_time_limit_returns_a_plan(solver: str) -> None:
    problem = spec_problem(1, 300, 8)
    # long enough for CBC to log its root bound even on a loaded machine
    got = solve(problem, solver=solver, time_limit_s=2.5, presolve=False)
    assert got.status in ("time_limit", "optimal")
    assert got.proven_optimal == (got.status == "optimal")
    assert got.objective == evaluate(problem, got.choices)
    assert got.gap is None or got.gap >= 0.0
    if solver == "cbc":  # read from CBC's log: "Lower bound:" when stopped, 0 when optimal
        assert got.gap is not None


def test_json_round_trip() -> None:
    problem = random_problem(3, memory=True)
    problem.memory_budget = 30.0
    problem.nodes[0].follow_note = "followed by 2 node(s)"
    assert IntraOpProblem.from_json(problem.to_json()) == problem
    solution = solve(problem)
    text = problem_to_json(problem, solution)
    assert IntraOpProblem.from_json(text) == problem
    section = json.loads(text)["solution"]
    assert section["choices"] == solution.choices
    assert section["strategies"] == [
        nd.strategy_names[c] for nd, c in zip(problem.nodes, solution.choices, strict=True)]
    assert IntraOpSolution.from_dict(section) == solution
    assert "choices" not in solution.to_dict()
    bad = json.loads(text)
    bad["version"] = 99
    with pytest.raises(PlanError):
        IntraOpProblem.from_dict(bad)


def test_unknown_solver() -> None:
    problem = random_problem(0)
    with pytest.raises(InvalidOptionError, match="auto, highs, cbc"):
        solve(problem, solver="gurobi")
    with pytest.raises(InvalidOptionError):
        min_peak_memory(problem, solver="glpk")


def test_stats_filled() -> None:
    problem = random_problem(5, n=6, kmin=3, kmax=4, p_edge=0.9)
    for solver in SOLVERS:
        got = solve(problem, solver=solver, presolve=False)
        assert got.solver == solver
        assert got.num_variables > 0 and got.num_constraints > 0
        assert got.build_time_s >= 0.0 and got.solve_time_s > 0.0 and got.gap is not None
        assert got.ilp_nodes == 6
        stats = got.to_dict()
        json.dumps(stats)
        assert set(stats) >= {"objective", "status", "proven_optimal", "gap", "solver",
                              "num_variables", "num_constraints", "build_time_s",
                              "solve_time_s"}
    assert solve(problem, solver="auto", presolve=False).solver in SOLVERS


def test_trivial_problems() -> None:
    empty = solve(IntraOpProblem([], []))
    assert empty.status == "trivial" and empty.choices == [] and empty.objective == 0.0
    single = IntraOpProblem([ProblemNode("a", [1.0], ["R"]), ProblemNode("b", [2.0], ["R"])],
                            [ProblemEdge(0, 1, [[0.5]])])
    got = solve(single)
    assert got.status == "trivial" and got.solver == "trivial" and got.objective == 3.5


def test_evaluate_and_peak_memory() -> None:
    problem = IntraOpProblem(
        [ProblemNode("a", [1.0, 2.0], ["R", "S"], [4.0, 2.0]), ProblemNode("b", [0.5], ["R"])],
        [ProblemEdge(0, 1, [[0.0], [0.25]])], live_sets=[[0, 1], [0, 0]])
    assert evaluate(problem, [1, 0]) == 2.75
    assert peak_memory(problem, [0, 0]) == 4.0  # a live set is a set: node 0 counts once
    with pytest.raises(ValueError):
        evaluate(problem, [2, 0])
    with pytest.raises(ValueError):
        brute_force(IntraOpProblem([ProblemNode(f"n{u}", [0.0] * 10, ["s"] * 10)
                                    for u in range(7)], []))
