"""Train steps written the ordinary Flax way (linen ``TrainState`` with an optax chain and a
schedule, dropout from a typed key; NNX split state with a functional optax update) give the
plain ``jax.jit`` step's numbers under every method (a pipelined step with dropout: those of a
serial step that draws its masks per microbatch)."""

import jax
import numpy as np
import optax
import pytest
from flax_models import BATCH, linen_setup, linen_train_step, make_nnx_train_step, nnx_setup
from step_runs import assert_same_run, run_steps

import autopar

PIPE = autopar.PipeshardParallel(num_microbatches=2, num_stages=2)


@pytest.mark.parametrize("method,dropout", [
    (autopar.DataParallel(), 0.2),
    (autopar.ShardParallel(mesh_shape=(2, 4)), 0.2),
    (PIPE, 0.0),
], ids=["data", "shard", "pipeshard"])
def test_linen_train_state_with_dropout_matches_jit(method, dropout):
    state, batch, key = linen_setup(dropout)
    want = run_steps(jax.jit(linen_train_step), state, batch, key)
    step = autopar.parallelize(linen_train_step, method=method, cache=False)
    assert_same_run(run_steps(step, state, batch, key), want)
    assert type(step.get_plan(state, batch, key)).__name__ == "Plan"


def per_microbatch_dropout_step(num_microbatches):
    """``linen_train_step`` with its loss function run on ``num_microbatches`` contiguous
    slices of the batch, the loss and the gradient their means. Every slice draws its dropout
    mask from the step's one key, as a pipelined step's microbatches do: equal shapes, so
    example ``i`` of every microbatch gets the same mask."""
    m = num_microbatches

    def step(state, batch, key):
        dropout_key = jax.random.fold_in(key, state.step)
        size = BATCH // m
        micro = [jax.tree_util.tree_map(lambda x, i=i: x[i * size:(i + 1) * size], batch)
                 for i in range(m)]

        def loss_fn(params):
            losses = [optax.softmax_cross_entropy_with_integer_labels(
                state.apply_fn({"params": params}, mb["image"], train=True,
                               rngs={"dropout": dropout_key}), mb["label"]).mean()
                for mb in micro]
            return sum(losses[1:], losses[0]) / m

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


def test_pipelined_dropout_is_drawn_per_microbatch_and_the_plan_says_so():
    state, batch, key = linen_setup(0.2)
    step = autopar.parallelize(linen_train_step, method=PIPE, cache=False)
    plan = step.get_plan(state, batch, key)
    assert any("each microbatch draws its own" in note for note in plan.notes), plan.notes
    got = run_steps(step, state, batch, key)
    # the numbers of a serial step that draws its masks per microbatch ...
    want = run_steps(jax.jit(per_microbatch_dropout_step(PIPE.num_microbatches)), state, batch, key)
    assert_same_run(got, want)
    # ... which are not those of the unpipelined step, as the note says
    full_batch_losses, _ = run_steps(jax.jit(linen_train_step), state, batch, key)
    assert not np.allclose(got[0], full_batch_losses, rtol=1e-3)


@pytest.mark.parametrize("method", [
    autopar.DataParallel(),
    autopar.ShardParallel(mesh_shape=(4, 2)),
    PIPE,
    None,  # the default full search
], ids=["data", "shard", "pipeshard", "default"])
def test_nnx_split_state_matches_jit(method):
    graphdef, state, batch = nnx_setup()
    train_step = make_nnx_train_step(graphdef)
    want = run_steps(jax.jit(train_step), state, batch)
    step = autopar.parallelize(train_step, method=method, cache=False)
    assert_same_run(run_steps(step, state, batch), want)
