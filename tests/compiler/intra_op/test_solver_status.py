"""Honest solver status: a solver that fails, or stops with no plan, is not reported as having
stopped at its time limit; the greedy plan it falls back on is named as such in the plan's
notes. The solvers' failures are simulated (monkeypatched), nothing is timed."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pulp
import pytest

import autopar
from autopar.compiler.intra_op import elimination, mip
from autopar.compiler.intra_op.ilp import evaluate, solve
from autopar.compiler.intra_op.problem import IlpStatus, IntraOpProblem, ProblemEdge, ProblemNode
from autopar.runtime.local_cluster import local_cluster

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def frustrated(n: int = 6) -> IntraOpProblem:
    """A cycle of disagreeing edges: presolve leaves it to the MIP."""
    nodes = [ProblemNode(f"op#{u}", [0.1 * u, 0.2, 0.15], ["A", "B", "C"]) for u in range(n)]
    edges = [ProblemEdge(u, (u + 1) % n if u + 1 < n else 0, [[0.0, 1.0, 0.7], [1.0, 0.0, 0.4],
                                                              [0.3, 0.9, 0.0]])
             for u in range(n - 1)]
    edges.append(ProblemEdge(0, n - 1, [[1.0, 0.0, 0.5], [0.0, 1.0, 0.2], [0.6, 0.1, 0.0]]))
    return IntraOpProblem(nodes, edges)


def test_a_cbc_failure_is_a_solver_error_with_the_greedy_plan(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise pulp.PulpSolverError("Pulp: Error while executing cbc")

    monkeypatch.setattr(pulp.LpProblem, "solve", broken)
    problem = frustrated()
    with caplog.at_level(logging.WARNING, logger="autopar.compiler.intra_op.mip"):
        got = solve(problem, solver="cbc", presolve=False)
    assert got.status == "solver_error" and not got.proven_optimal
    assert got.objective == evaluate(problem, got.choices)
    assert any("CBC raised PulpSolverError" in r.getMessage() for r in caplog.records)


def test_highs_stopping_without_a_plan_is_no_solution(monkeypatch):
    monkeypatch.setattr(mip, "_run_highs",
                        lambda model, limit, gap: (None, IlpStatus.TIME_LIMIT, None))
    monkeypatch.setattr(mip, "lp_rounding", lambda model, limit: (float("-inf"), {}))
    from autopar.compiler.intra_op import ilp

    monkeypatch.setattr(ilp, "lp_rounding", lambda model, limit: (float("-inf"), {}))
    got = solve(frustrated(), solver="highs", presolve=False)
    assert got.status == "no_solution" and not got.proven_optimal


def test_highs_error_status_is_a_solver_error(monkeypatch):
    def failing(model, limit, gap):
        raise mip._SolverFailed("HiGHS ended with Solve error")

    monkeypatch.setattr(mip, "_run_highs", failing)
    result = mip.run_mip(mip.build_mip(*_reduced(frustrated())), "highs", 1.0)
    assert result.status == IlpStatus.SOLVER_ERROR and "Solve error" in result.message


def _reduced(problem):
    from autopar.compiler.intra_op.presolve import presolve

    return presolve(problem, False), None


def test_the_shard_plan_names_a_solver_failure(monkeypatch):
    monkeypatch.setattr(elimination, "MAX_WORK", 0)  # what elimination would answer goes to
    monkeypatch.setattr(elimination, "WORK_PER_PAIR", 0)  # the MIP

    def broken(*args, **kwargs):
        raise pulp.PulpSolverError("Pulp: Error while executing cbc")

    monkeypatch.setattr(pulp.LpProblem, "solve", broken)

    def step(state, batch):
        def loss_fn(w):
            return jnp.mean(jnp.tanh(jnp.tanh(batch @ w[0]) @ w[1]) ** 2)

        loss, grads = jax_value_and_grad(loss_fn)(state)
        return [w - 0.1 * g for w, g in zip(state, grads, strict=True)], loss

    state = [jnp.ones((16, 16)), jnp.ones((16, 16))]
    batch = jnp.ones((32, 16))
    par = autopar.parallelize(step, method=autopar.ShardParallel(solver="cbc"), cache=False,
                              devices=local_cluster_devices())
    plan = par.get_plan(state, batch)
    assert plan.solver["solver"] == "cbc"  # decided by the MIP, not by presolve alone
    assert plan.solver["status"] == "solver_error"
    assert any("the ILP solver (cbc) failed" in n for n in plan.notes)
    assert not any("time limit" in n for n in plan.notes)


def jax_value_and_grad(fn):
    import jax

    return jax.value_and_grad(fn)


def local_cluster_devices():
    import jax

    assert local_cluster().num_devices == len(jax.devices())
    return jax.devices()


@pytest.mark.parametrize("status", ["time_limit", "no_solution", "solver_error"])
def test_stage_cost_ilp_statuses_are_counted(status, monkeypatch):
    """Every stage-cost ILP's ending is counted in the plan's stage search and notes."""
    from autopar.compiler.inter_op import piece_cost
    from autopar.compiler.intra_op.problem import IntraOpSolution

    real = piece_cost.solve

    def stopped(problem, **kwargs):
        got = real(problem, **kwargs)
        return IntraOpSolution(got.choices, got.objective, status, False, None, "highs", 0, 0,
                               0.0, 0.0)

    monkeypatch.setattr(piece_cost, "solve", stopped)

    def step(state, batch):
        def loss_fn(w):
            return jnp.mean(jnp.tanh(jnp.tanh(batch @ w[0]) @ w[1]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(state)
        return [w - 0.1 * g for w, g in zip(state, grads, strict=True)], loss

    state = [jnp.ones((16, 16)), jnp.ones((16, 16))]
    plan = autopar.parallelize(step, method=autopar.PipeshardParallel(layers=2),
                               cache=False).get_plan(state, jnp.ones((32, 16)))
    counts = plan.planning.stage_search["ilp_statuses"]
    assert counts == {status: plan.planning.stage_search["ilp_solves"]}
    assert any(f"{counts[status]} of {counts[status]} stage-cost ILPs" in n for n in plan.notes)
