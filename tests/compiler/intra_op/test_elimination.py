"""Exact elimination of a presolved sharding ILP (``elimination``): the optimum brute force and
the MIP know, the price it predicts before doing any work, and where ``solve`` uses it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ilp_problems import random_problem, spec_problem

from autopar.compiler.intra_op import elimination
from autopar.compiler.intra_op.elimination import elimination_order, solve_by_elimination
from autopar.compiler.intra_op.ilp import brute_force, evaluate, solve
from autopar.compiler.intra_op.presolve import complete_choices
from autopar.compiler.intra_op.presolve import presolve as reduce_problem


def assert_same(a: float, b: float) -> None:
    assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (a, b)


def test_matches_brute_force_on_dense_graphs() -> None:
    """Dense random graphs keep nodes of degree 3-8 after presolve: elimination builds tables
    over several nodes, and its plan is the brute-force optimum."""
    wide = 0
    for seed in range(20):
        problem = random_problem(seed, n=9, kmin=2, kmax=4, p_edge=0.7)
        _, want = brute_force(problem)
        for exact in (True, False):  # presolved, and every node left to elimination
            r = reduce_problem(problem, exact)
            core = solve_by_elimination(r)
            assert core is not None and set(core) == set(r.cost)
            assert_same(evaluate(problem, complete_choices(r, len(problem.nodes), core)), want)
            sizes = {u: len(c) for u, c in r.cost.items()}
            order, _ = elimination_order(sizes, {u: set(a) for u, a in r.adj.items()})
            wide += max((len(r.adj[u]) for u in order), default=0) >= 3
    assert wide >= 20  # the instances are not chains and trees that presolve finishes alone


def test_the_price_is_the_tables_it_builds() -> None:
    """``elimination_order``'s work is the summed size of the tables the elimination builds:
    a star of four 3-strategy leaves around a 5-strategy hub: three leaves first (3 x 5
    each), then the hub and the last leaf tie (5 x 3) and the hub goes by its number, then
    the leaf alone (3)."""
    sizes = {0: 5, 1: 3, 2: 3, 3: 3, 4: 3}
    adj = {0: {1, 2, 3, 4}, 1: {0}, 2: {0}, 3: {0}, 4: {0}}
    order, work = elimination_order(sizes, adj)
    assert order == [1, 2, 3, 0, 4] and work == 4 * 15 + 3
    partial, over = elimination_order(sizes, adj, limit=40)
    assert partial == [1, 2] and over > 40


def test_refuses_past_its_price_and_with_memory_rows() -> None:
    problem = spec_problem(2, 120, 6)
    r = reduce_problem(problem, True)
    assert r.cost  # presolve alone does not finish it
    sizes = {u: len(c) for u, c in r.cost.items()}
    _, work = elimination_order(sizes, {u: set(a) for u, a in r.adj.items()})
    assert solve_by_elimination(r, max_work=work - 1) is None
    core = solve_by_elimination(r, max_work=work)
    assert core is not None
    exact = solve(problem, solver="highs", elimination=False)
    assert_same(evaluate(problem, complete_choices(r, len(problem.nodes), core)), exact.objective)

    r.rows = [([(u, np.arange(float(n))) for u, n in list(sizes.items())[:3]], 1.0)]
    assert solve_by_elimination(r, max_work=work) is None  # memory rows are the MIP's


@pytest.mark.parametrize("seed", range(4))
def test_solve_answers_by_elimination(seed: int) -> None:
    """``solve`` takes the elimination path on spec-shaped problems presolve cannot finish,
    and its answer is the MIP's optimum (and never worse than a given start)."""
    problem = spec_problem(seed, 60, 5)
    got = solve(problem, solver="highs")
    exact = solve(problem, solver="highs", elimination=False)
    assert got.solver == "elimination" and got.proven_optimal and got.gap == 0.0
    assert got.objective <= exact.objective * (1 + 1e-9)
    assert_same(got.objective, exact.objective)
    assert got.objective == evaluate(problem, got.choices)
    started = solve(problem, solver="highs", start=exact.choices)
    assert started.objective <= evaluate(problem, exact.choices)


def test_too_costly_goes_to_the_solvers(monkeypatch) -> None:
    monkeypatch.setattr(elimination, "MAX_WORK", 0)
    problem = spec_problem(1, 60, 5)
    got = solve(problem, solver="highs")
    assert got.solver != "elimination" and got.proven_optimal
    assert not math.isnan(got.objective) and np.isfinite(got.objective)
