"""Train steps written the ordinary Flax way (linen ``TrainState`` with an optax chain and a
schedule, dropout from a typed key; NNX split state with a functional optax update) give the
plain ``jax.jit`` step's numbers under every method, a pipelined step with dropout included
(it draws the whole batch's masks once per step, as the serial step does)."""

import jax
import pytest
from flax_models import linen_setup, linen_train_step, make_nnx_train_step, nnx_setup
from step_runs import assert_same_run, run_steps

import autopar

PIPE = autopar.PipeshardParallel(num_microbatches=2, num_stages=2)


@pytest.mark.parametrize("method,dropout", [
    (autopar.DataParallel(), 0.2),
    (autopar.ShardParallel(mesh_shape=(2, 4)), 0.2),
    (PIPE, 0.2),
], ids=["data", "shard", "pipeshard"])
def test_linen_train_state_with_dropout_matches_jit(method, dropout):
    state, batch, key = linen_setup(dropout)
    want = run_steps(jax.jit(linen_train_step), state, batch, key)
    step = autopar.parallelize(linen_train_step, method=method, cache=False)
    assert_same_run(run_steps(step, state, batch, key), want)
    assert type(step.get_plan(state, batch, key)).__name__ == "Plan"


def test_pipelined_dropout_draws_the_serial_masks():
    # flax's Dropout draws bits per example from a key folded in per module: the pipeline
    # draws the whole batch's once per step and cuts them like the batch, so every example
    # gets the mask the unpipelined step gives it, and the plan has no note to make
    state, batch, key = linen_setup(0.2)
    step = autopar.parallelize(linen_train_step, method=PIPE, cache=False)
    plan = step.get_plan(state, batch, key)
    assert not any("draws anew" in note for note in plan.notes), plan.notes
    assert_same_run(run_steps(step, state, batch, key),
                    run_steps(jax.jit(linen_train_step), state, batch, key))


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
