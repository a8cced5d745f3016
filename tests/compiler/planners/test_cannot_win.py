"""A one-stage candidate whose fastest plan is over the memory budget and already no faster
than a plan that fits is left there (``CannotWinError``): the full search does not solve it
under the budget nor trace it again with recomputation. Planning only; nothing is timed."""

import jax
import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.planners import dispatch, shard
from autopar.compiler.planners.step_program import StepProgram
from autopar.errors import CannotWinError
from autopar.models import get_model


def test_a_candidate_that_cannot_beat_a_fitting_plan_is_not_solved_under_the_budget(
        monkeypatch):
    model = get_model("gpt", "tiny", batch_size=64).with_value_and_grad(autopar.value_and_grad)
    args = (model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1)))
    cluster = load_cluster("cpu-sim")
    roomy = dispatch.plan(dispatch.trace(model.train_step, args, autopar.ShardParallel(),
                                         (1,)), cluster).plan
    # 0.8: a budget the fastest plan overfills and a budgeted ILP meets in well under a second
    # (at 0.9 the memory rows make that MIP take about 9 s; what is checked is the same)
    budget = 0.8 * roomy.peak_memory_bytes
    method = autopar.ShardParallel(remat="auto", memory_budget_bytes=budget)
    step = dispatch.trace(model.train_step, args, method, (1,))

    budgets, rematerialised = [], []
    solve, remat = shard.plan_shard_parallel, StepProgram.rematerialised
    monkeypatch.setattr(shard, "plan_shard_parallel", lambda traced, mesh, options, **kw: (
        budgets.append(options.memory_budget_bytes) or solve(traced, mesh, options, **kw)))
    monkeypatch.setattr(StepProgram, "rematerialised", lambda *a, **kw: (
        rematerialised.append(a) or remat(*a, **kw)))

    # a plan that fits is estimated at the fastest plan's time: nothing left can beat it
    with pytest.raises(CannotWinError, match="not solved under the memory budget") as err:
        dispatch._plan_one_stage_with_remat(step, cluster, None, None, roomy.est_step_time_s)
    assert budgets == [None] and not rematerialised  # only the fastest plan was solved
    assert err.value.estimate_s == pytest.approx(roomy.est_step_time_s)
    assert err.value.peak_bytes == roomy.peak_memory_bytes > budget

    # against a slower one the rest runs, from the same fastest plan (not solved again), and
    # what fits is no faster than the fastest plan: leaving it above was safe
    planned = dispatch._plan_one_stage_with_remat(step, cluster, None, None,
                                                  2 * roomy.est_step_time_s)
    assert budgets.count(None) == 1 and (budget in budgets or rematerialised)
    assert planned.plan.peak_memory_bytes <= budget
    assert planned.plan.est_step_time_s >= roomy.est_step_time_s
