"""Keras 3 on the JAX backend, trained with its stateless loop (``stateless_call`` and
``optimizer.stateless_apply``), dropout seeds carried as non-trainable state: every method,
pipelines included, gives the plain ``jax.jit`` step's losses and updated state."""

import os

# before keras is imported (in the tests, so that collecting this module, as the fast tier
# does too, does not import it): its backend is fixed then
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import pytest  # noqa: E402

import autopar  # noqa: E402
from tests.support.step_runs import assert_same_run, run_steps  # noqa: E402

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def keras_parts():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(4),
    ])
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    return model, optimizer, state


def make_step(model, optimizer, value_and_grad):
    import keras

    loss_object = keras.losses.MeanSquaredError()

    def compute_loss(trainable, non_trainable, x, y):
        pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_object(y, pred), non_trainable

    def step(state, batch):
        trainable, non_trainable, opt_vars = state
        (loss, non_trainable), grads = value_and_grad(compute_loss, has_aux=True)(
            trainable, non_trainable, batch["x"], batch["y"])
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return (trainable, non_trainable, opt_vars), loss

    return step


METHODS = {
    "data": autopar.DataParallel(),
    "shard": autopar.ShardParallel(mesh_shape=(2, 4)),
    "zero3": autopar.Zero3Parallel(),
    "pipeshard": autopar.PipeshardParallel(num_microbatches=2, num_stages=2, stages="uniform"),
    # one stage runs as one program, its microbatches a loop (``runtime.fused_step``)
    "pipeshard-1": autopar.PipeshardParallel(num_microbatches=4, num_stages=1,
                                             stages="uniform"),
    # the default full search, its own choice kept (timing candidates first,
    # ``measure_candidates``, is tests/runtime/test_measured_choice.py's subject)
    "default": autopar.AutoParallel(measure_candidates=0),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_keras_stateless_loop_matches_jit(name):
    model, optimizer, state = keras_parts()
    k = jax.random.split(jax.random.key(1), 2)
    batch = {"x": jax.random.normal(k[0], (16, 8)), "y": jax.random.normal(k[1], (16, 4))}
    # the seed generator's state is the model's non-trainable variable, a uint32 counter
    assert [v.dtype for v in state[1]] == ["uint32"]
    step = autopar.parallelize(make_step(model, optimizer, autopar.value_and_grad),
                               method=METHODS[name], cache=False)
    got = run_steps(step, state, batch)
    assert_same_run(got, run_steps(jax.jit(make_step(model, optimizer, jax.value_and_grad)),
                                   state, batch))
    # the counter advanced as in the serial step, in its own dtype
    assert got[1][1][0].dtype == state[1][0].dtype
    if name.startswith("pipeshard"):
        assert len(step.get_plan(state, batch).stages) == METHODS[name].num_stages
