"""Train steps written the ordinary Flax way (linen ``TrainState`` with an optax chain and a
schedule, dropout from a typed key; NNX split state with a functional optax update) give the
plain ``jax.jit`` step's numbers under every method."""

import jax
import numpy as np
import pytest
from flax_models import linen_setup, linen_train_step, make_nnx_train_step, nnx_setup

import autopar

STEPS = 3
PIPE = autopar.PipeshardParallel(num_microbatches=2, num_stages=2)


def run(step, state, *rest, steps=STEPS):
    losses = []
    for _ in range(steps):
        state, loss = step(state, *rest)
        losses.append(float(loss))
    return losses, state


def assert_same(got, want):
    (gl, gs), (wl, ws) = got, want
    np.testing.assert_allclose(gl, wl, rtol=2e-5)
    for a, b in zip(jax.tree_util.tree_leaves(gs), jax.tree_util.tree_leaves(ws), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("method,dropout", [
    (autopar.DataParallel(), 0.2),
    (autopar.ShardParallel(mesh_shape=(2, 4)), 0.2),
    (PIPE, 0.0),
], ids=["data", "shard", "pipeshard"])
def test_linen_train_state_with_dropout_matches_jit(method, dropout):
    state, batch, key = linen_setup(dropout)
    want = run(jax.jit(linen_train_step), state, batch, key)
    step = autopar.parallelize(linen_train_step, method=method, cache=False)
    assert_same(run(step, state, batch, key), want)
    assert type(step.get_plan(state, batch, key)).__name__ == "Plan"


def test_pipelined_dropout_is_drawn_per_microbatch_and_the_plan_says_so():
    state, batch, key = linen_setup(0.2)
    step = autopar.parallelize(linen_train_step, method=PIPE, cache=False)
    plan = step.get_plan(state, batch, key)
    assert any("each microbatch draws its own" in note for note in plan.notes), plan.notes
    _, loss = step(state, batch, key)
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("method", [
    autopar.DataParallel(),
    autopar.ShardParallel(mesh_shape=(4, 2)),
    PIPE,
    None,  # the default full search
], ids=["data", "shard", "pipeshard", "default"])
def test_nnx_split_state_matches_jit(method):
    graphdef, state, batch = nnx_setup()
    train_step = make_nnx_train_step(graphdef)
    want = run(jax.jit(train_step), state, batch)
    step = autopar.parallelize(train_step, method=method, cache=False)
    assert_same(run(step, state, batch), want)
