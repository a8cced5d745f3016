"""Saved plans: a step runs a plan from a file without planning, and a plan made for other
inputs is refused with one line."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.errors import InvalidOptionError, PlanError

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

OPT = optax.sgd(0.1)


def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"])
    h = autopar.mark_pipeline_boundary(h)
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def step(state, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(state["p"], batch)
    updates, opt_state = OPT.update(grads, state["o"], state["p"])
    return {"p": optax.apply_updates(state["p"], updates), "o": opt_state}, loss


def inputs(batch_size=16):
    k = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(k[0], (8, 16)) * 0.3, "w2": jax.random.normal(k[1], (16, 4))}
    batch = {"x": jax.random.normal(k[2], (batch_size, 8)),
             "y": jax.random.normal(k[3], (batch_size, 4))}
    return {"p": p, "o": OPT.init(p)}, batch


@pytest.mark.parametrize("method", [
    autopar.ShardParallel(mesh_shape=(2, 4)),
    autopar.PipeshardParallel(num_microbatches=2, layers="marked", stages="uniform",
                              num_stages=2),
], ids=["shard", "pipeshard"])
def test_saved_plan_runs_without_planning_and_gives_the_same_numbers(method, tmp_path):
    state, batch = inputs()
    planned = autopar.parallelize(step, method=method)
    plan = planned.get_plan(state, batch)
    path = tmp_path / "plan.json"
    plan.save(path)

    reloaded = autopar.parallelize(step, plan=path)
    got = reloaded.get_plan(state, batch)
    assert got == autopar.Plan.load(path)  # the file's plan, not a new search
    a, la = planned(state, batch)
    b, lb = reloaded(state, batch)
    assert float(lb) == pytest.approx(float(la), rel=1e-6)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-7)


def test_a_plan_for_other_inputs_is_refused_in_one_line(tmp_path):
    state, batch = inputs(16)
    path = tmp_path / "plan.json"
    autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(8,))).get_plan(
        state, batch).save(path)
    other_state, other_batch = inputs(32)
    with pytest.raises(PlanError, match=r"input 'batch/x' is float32\[32, 8\] here but the plan "
                                        r"has 'batch/x' as float32\[16, 8\]") as err:
        autopar.parallelize(step, plan=path).get_plan(other_state, other_batch)
    assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match="cannot read plan file"):
        autopar.parallelize(step, plan=tmp_path / "missing.json")
    with pytest.raises(InvalidOptionError, match="the plan was made by method 'shard'"):
        autopar.parallelize(step, method=autopar.DataParallel(), plan=path)
