"""Train steps written the ordinary Flax way (linen ``TrainState`` with an optax chain and a
schedule, dropout from a typed key; NNX split state with a functional optax update) give the
plain ``jax.jit`` step's numbers under every method, a pipelined step with dropout included
(it draws the whole batch's masks once per step, as the serial step does), and kernels boxed
with ``nn.with_partitioning``."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax_models import linen_setup, linen_train_step, make_nnx_train_step, nnx_setup
from step_runs import assert_same_run, run_steps

import autopar

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

PIPE = autopar.PipeshardParallel(num_microbatches=2, num_stages=2)
# the default full search, its own choice kept: compiling and timing candidates first
# (``measure_candidates``) is tests/runtime/test_measured_choice.py's subject, not these tests'
SEARCH = autopar.AutoParallel(measure_candidates=0)


@functools.cache
def linen_reference(dropout):
    """The plain ``jax.jit`` run of ``linen_setup(dropout)`` (fixed seeds: the same for every
    method compared with it), computed once per process."""
    state, batch, key = linen_setup(dropout)
    return run_steps(jax.jit(linen_train_step), state, batch, key)


@functools.cache
def nnx_reference():
    """The plain ``jax.jit`` run of ``nnx_setup()``, computed once per process."""
    graphdef, state, batch = nnx_setup()
    return run_steps(jax.jit(make_nnx_train_step(graphdef)), state, batch)


# PipeshardParallel's case is test_pipelined_dropout_draws_the_serial_masks: the same setup,
# method and comparison (it was run twice, once in each test)
@pytest.mark.parametrize("method,dropout", [
    (autopar.DataParallel(), 0.2),
    (autopar.ShardParallel(mesh_shape=(2, 4)), 0.2),
], ids=["data", "shard"])
def test_linen_train_state_with_dropout_matches_jit(method, dropout):
    state, batch, key = linen_setup(dropout)
    step = autopar.parallelize(linen_train_step, method=method, cache=False)
    assert_same_run(run_steps(step, state, batch, key), linen_reference(dropout))
    assert type(step.get_plan(state, batch, key)).__name__ == "Plan"


def test_pipelined_dropout_draws_the_serial_masks():
    # flax's Dropout draws bits per example from a key folded in per module: the pipeline
    # draws the whole batch's once per step and cuts them like the batch, so every example
    # gets the mask the unpipelined step gives it, and the plan has no note to make (also
    # test_linen_train_state_with_dropout_matches_jit's PipeshardParallel case)
    state, batch, key = linen_setup(0.2)
    step = autopar.parallelize(linen_train_step, method=PIPE, cache=False)
    plan = step.get_plan(state, batch, key)
    assert type(plan).__name__ == "Plan"
    assert not any("draws anew" in note for note in plan.notes), plan.notes
    assert_same_run(run_steps(step, state, batch, key), linen_reference(0.2))


@pytest.mark.parametrize("method", [
    autopar.DataParallel(),
    autopar.ShardParallel(mesh_shape=(4, 2)),
    PIPE,
    SEARCH,  # the default full search
], ids=["data", "shard", "pipeshard", "default"])
def test_nnx_split_state_matches_jit(method):
    graphdef, state, batch = nnx_setup()
    step = autopar.parallelize(make_nnx_train_step(graphdef), method=method, cache=False)
    assert_same_run(run_steps(step, state, batch), nnx_reference())


class PartitionedMLP(nn.Module):
    """Kernels boxed with ``nn.with_partitioning`` (logical axis names, Megatron's split)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.tanh(nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, "model")))(x))
        return nn.Dense(4, kernel_init=nn.with_partitioning(init, ("model", None)))(x)


@pytest.mark.parametrize("method", [
    autopar.ShardParallel(mesh_shape=(2, 4)),
    autopar.PipeshardParallel(num_microbatches=2, num_stages=2, stages="uniform"),
    SEARCH,
], ids=["shard", "pipeshard", "default"])
def test_linen_with_partitioning_metadata_matches_jit(method):
    model, opt = PartitionedMLP(), optax.adam(1e-2)
    k = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(k[0], (16, 8)), "y": jax.random.normal(k[1], (16, 4))}
    params = model.init(k[2], batch["x"])["params"]
    assert isinstance(params["Dense_0"]["kernel"], nn.Partitioned)

    def make(value_and_grad):
        def step(state, batch):
            def loss_fn(p, batch):
                return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

            loss, grads = value_and_grad(loss_fn)(state["p"], batch)
            updates, o = opt.update(grads, state["o"], state["p"])
            return {"p": optax.apply_updates(state["p"], updates), "o": o}, loss

        return step

    state = {"p": params, "o": opt.init(params)}
    step = autopar.parallelize(make(autopar.value_and_grad), method=method, cache=False)
    got = run_steps(step, state, batch)
    assert isinstance(got[1]["p"]["Dense_0"]["kernel"], nn.Partitioned)  # the boxes come back
    assert_same_run(got, run_steps(jax.jit(make(jax.value_and_grad)), state, batch))
