"""The default method (``autopar.parallelize(step)``: the full search over stages, submeshes
and intra-operator plans) gives the serial step's numbers on the zoo models at size tiny.

Each case differentiates the loss with ``autopar.value_and_grad`` (so the search may pipeline
it), runs 3 steps of whatever plan the search chose and compares the loss of every step and
every updated state leaf with a plain single-device ``jax.jit`` step (fp32), at the tolerances
of tests/test_shard_numerics.py (the zoo trains with Adam; see ``ZooModel.optimizer``).
The search runs with ``measure_candidates=0``: it keeps its own (estimated) choice rather than
compiling and timing three candidates first, which was half of these tests' time and made the
plan compared depend on the machine's load. Timing and keeping the fastest measured plan, and
that plan's numbers, are tests/runtime/test_measured_choice.py's subject.

GPT's and MoE's losses are means over the batch, so a pipelined step is the full-batch step up
to summation order, and they are compared with the zoo's own step. Wide-ResNet's batch norm
normalises by the statistics of the batch it sees, so its loss mixes the examples of the batch:
the search leaves its pipelined candidates out (``graph.batch_coupling``; a pipeline would run it
per microbatch, another loss), and its reference is the plain serial step. Were a pipeline
chosen (``per_microbatch_statistics=True``), the reference would be the serial step with the
loss function run on the same contiguous microbatches, results and gradients averaged: what
such a pipeline computes (``microbatched_train_step``).
"""

import functools
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from serial_reference import serial_run

import autopar
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3
# fraction of the learning rate parameters may differ by, as in test_shard_numerics
PARAM_ATOL_IN_LR = {"gpt": 2e-3, "moe": 2e-3, "wresnet": 2e-2}
# Wide-ResNet's last block is 1x1 pixels: in a microbatch of 2 images (tiny's 8 over the
# search's 4 microbatches) each batch norm there normalises 2 numbers to +-1, whose fp32
# gradient is mostly rounding (0.3% off the fp64 one, serial or pipelined alike), and Adam
# turns that into a 1e-3 relative loss difference by the second step. With 32 images a
# microbatch holds as many as the unpipelined tiny step, and fp32 gradients agree with fp64
# ones to ~5e-6; 16-pixel images keep the convolutions as cheap as tiny's.
OVERRIDES = {"wresnet": {"batch_size": 32, "image_size": 16}}
# the default method's search, its choice kept without timing candidates (see the docstring)
SEARCH = autopar.AutoParallel(measure_candidates=0)


def zoo(name):
    return get_model(name, "tiny", **OVERRIDES.get(name, {})).with_value_and_grad(
        autopar.value_and_grad)


def microbatched_train_step(model, num_microbatches):
    """Wide-ResNet's ``train_step`` with the loss function (and its batch norm) run on
    ``num_microbatches`` contiguous slices of the batch; the loss, the updated running
    statistics and the gradient are their means."""
    m = num_microbatches

    def step(state, batch):
        params = state["params"]
        extra = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
        # [m, batch / m, ...]: microbatch i is rows i * batch / m onwards, as in the pipeline
        micro = jax.tree_util.tree_map(lambda x: x.reshape(m, -1, *x.shape[1:]), batch)

        def objective(p):
            # one compiled body for all microbatches (an unrolled loop compiles m networks)
            outs = jax.lax.map(
                lambda mb: model.family.loss_with_extra(p, extra, mb, model.config), micro)
            return jax.tree_util.tree_map(lambda x: x.mean(axis=0), outs)

        (loss, new_extra), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = model.optimizer.update(grads, state["opt_state"], params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
                **new_extra}, loss

    return step


@functools.cache
def reference(name, num_microbatches):
    """Losses and final state leaves of the serial step (microbatched as the plan is, for
    batch norm)."""
    model = zoo(name)
    if model.family.init_extra is None or num_microbatches == 1:
        return serial_run(model, STEPS)
    return serial_run(SimpleNamespace(
        init_state=model.init_state, make_batch=model.make_batch,
        train_step=microbatched_train_step(model, num_microbatches)), STEPS)


@pytest.mark.parametrize("name", sorted(PARAM_ATOL_IN_LR))
def test_default_method_equals_serial(name):
    model = zoo(name)
    step = autopar.parallelize(model.train_step, method=SEARCH)
    state = model.init_state(jax.random.key(0))
    plan = step.get_plan(state, model.make_batch(jax.random.key(0)))
    # the full search: whichever method it chose, the numerics are the serial step's
    assert plan.planning.method_options["method"] == "auto"
    assert sorted(d for st in plan.stages for d in st.device_ids) == list(range(8))
    ref_losses, ref_leaves = reference(name, plan.num_microbatches)
    for i in range(STEPS):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6), i
    atol = PARAM_ATOL_IN_LR[name] * model.config.learning_rate
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    for path, want, got in zip(paths, ref_leaves, jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol, err_msg=path)
