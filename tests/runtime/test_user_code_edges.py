"""Model code written outside autopar, at the edges users hit first under pipelining: a
constant the loss closes over, a mean's divisor built from the batch shape, parameters
already committed to the user's own mesh, and the model's own ``with_sharding_constraint``.
Each pipelined run is compared with the plain ``jax.jit`` step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from tests.support.step_runs import assert_same_run, run_steps

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

OPT = optax.adam(0.05)
CONSTANT = jnp.arange(1.0, 5.0)


def _layers(params, x):
    h = jnp.tanh(x @ params["w1"])
    h = jnp.tanh(h @ params["w2"])
    return h @ params["w3"]


def captured_constant_loss(params, x):
    return jnp.mean(jnp.tanh(_layers(params, x)) * CONSTANT)


def shape_divisor_loss(params, x):
    # what libraries' default mean reduction does: a divisor baked in from the traced shape
    v = jnp.tanh(_layers(params, x))
    return jnp.sum(v) / jnp.prod(jnp.asarray(v.shape))


def make_step(loss_fn, value_and_grad):
    def step(state, batch):
        loss, grads = value_and_grad(loss_fn)(state["p"], batch)
        updates, opt = OPT.update(grads, state["o"], state["p"])
        return {"p": optax.apply_updates(state["p"], updates), "o": opt}, loss

    return step


def inputs():
    k = jax.random.split(jax.random.key(1), 4)
    p = {"w1": jax.random.normal(k[0], (8, 16)) * 0.3,
         "w2": jax.random.normal(k[1], (16, 16)) * 0.3,
         "w3": jax.random.normal(k[2], (16, 4)) * 0.3}
    return {"p": p, "o": OPT.init(p)}, jax.random.normal(k[3], (16, 8))


def two_stages():
    return autopar.PipeshardParallel(num_microbatches=2, num_stages=2, stages="uniform")


def assert_pipeline_equals_serial(loss_fn, state, batch, method, stages):
    step = autopar.parallelize(make_step(loss_fn, autopar.value_and_grad), method=method,
                               cache=False)
    plan = step.get_plan(state, batch)
    assert len(plan.stages) == stages
    assert_same_run(run_steps(step, state, batch),
                    run_steps(jax.jit(make_step(loss_fn, jax.value_and_grad)), state, batch))
    return plan


def test_a_constant_the_loss_closes_over_reaches_every_stage():
    state, batch = inputs()
    assert_pipeline_equals_serial(captured_constant_loss, state, batch, two_stages(), 2)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_divisor_built_from_the_batch_shape_is_the_microbatch_one(stages):
    # taken from the whole batch's trace it halved the loss (two microbatches) silently
    state, batch = inputs()
    method = autopar.PipeshardParallel(num_microbatches=2, num_stages=stages, stages="uniform")
    assert_pipeline_equals_serial(shape_divisor_loss, state, batch, method, stages)


@pytest.mark.parametrize("shape", [(), (4,)], ids=["scalar", "vector"])
def test_a_batch_sized_constant_used_inside_and_outside_the_loss(shape):
    # the loss runs per microbatch with the microbatch's value; the update keeps the batch's
    state, batch = inputs()

    def make(value_and_grad):
        def step(state, x):
            count = jnp.full(shape, x.shape[0], jnp.float32)

            def loss_fn(p, x):
                return jnp.mean(jnp.sum(_layers(p, x)) / count)

            loss, grads = value_and_grad(loss_fn)(state["p"], x)
            new = jax.tree.map(lambda p, g: p - 0.1 * g / jnp.mean(count), state["p"], grads)
            return {"p": new, "o": state["o"]}, loss

        return step

    step = autopar.parallelize(make(autopar.value_and_grad), method=two_stages(), cache=False)
    assert len(step.get_plan(state, batch).stages) == 2
    assert_same_run(run_steps(step, state, batch),
                    run_steps(jax.jit(make(jax.value_and_grad)), state, batch))


@pytest.mark.parametrize("spec", [P(), P("fsdp")], ids=["replicated", "split"])
@pytest.mark.parametrize("stages", [1, 2])
def test_parameters_committed_to_the_users_mesh(spec, stages):
    state, batch = inputs()
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def commit(x):
        fits = x.ndim and x.shape[0] % mesh.size == 0
        return jax.device_put(x, NamedSharding(mesh, spec if fits else P()))

    committed = jax.tree.map(commit, state)
    method = autopar.PipeshardParallel(num_microbatches=2, num_stages=stages, stages="uniform")
    step = autopar.parallelize(make_step(captured_constant_loss, autopar.value_and_grad),
                               method=method, cache=False)
    assert len(step.get_plan(committed, batch).stages) == stages
    assert_same_run(run_steps(step, committed, batch),
                    run_steps(jax.jit(make_step(captured_constant_loss, jax.value_and_grad)),
                              state, batch))


def test_the_models_own_sharding_constraints_are_left_out_of_the_stages_with_a_note():
    state, batch = inputs()
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def constrained_loss(params, x):
        h = jnp.tanh(x @ params["w1"])
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("d")))
        h = jnp.tanh(h @ params["w2"])
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P()))
        return jnp.mean((h @ params["w3"]) ** 2)

    plan = assert_pipeline_equals_serial(constrained_loss, state, batch, two_stages(), 2)
    assert any("2 with_sharding_constraint" in n for n in plan.notes), plan.notes


def test_a_key_the_step_makes_and_the_loss_closes_over_is_compared_by_its_data():
    # two traces make two key arrays: equal keys, which NumPy cannot compare directly
    state, batch = inputs()

    def make(value_and_grad):
        def step(state, x):
            key = jax.random.key(3)

            def loss_fn(p, x):
                return jnp.mean(_layers(p, x) * jax.random.normal(key, (4,)))

            loss, grads = value_and_grad(loss_fn)(state["p"], x)
            return {"p": jax.tree.map(lambda p, g: p - 0.1 * g, state["p"], grads),
                    "o": state["o"]}, loss

        return step

    step = autopar.parallelize(make(autopar.value_and_grad), method=two_stages(), cache=False)
    assert_same_run(run_steps(step, state, batch),
                    run_steps(jax.jit(make(jax.value_and_grad)), state, batch))
