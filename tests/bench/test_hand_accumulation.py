"""The bench's hand-written gradient accumulation, the reference a one-stage pipeline is timed
against: it must do the pipeline's work with the serial step's numbers, or the ratio would
compare unlike steps."""

import jax
import numpy as np
import pytest

import autopar
from autopar.bench.hand_accumulation import accumulation_step, jit_accumulation
from autopar.bench.measure import make_inputs
from autopar.compiler.planners import dispatch
from autopar.errors import InvalidOptionError
from autopar.models import get_model
from autopar.runtime.local_cluster import local_cluster

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def _close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_accumulated_microbatches_give_the_serial_step():
    """The MLP's loss is a mean over the batch, so the mean of 4 equal microbatches' losses
    and gradients is the whole batch's: one accumulated step equals ``jax.jit(train_step)``."""
    model = get_model("mlp", "tiny")
    inputs = make_inputs(model)
    serial_state, serial_loss = jax.jit(model.train_step)(inputs.state, inputs.batch)
    state, loss = jax.jit(accumulation_step(model, 4))(inputs.state, inputs.batch)
    _close(loss, serial_loss)
    _close(state, serial_state)


def test_batch_statistics_are_the_microbatches_mean():
    """Wide-ResNet's new batch statistics are each microbatch's, averaged (the pipeline's aux
    rule), which differs from the whole batch's: with one microbatch it is the serial step."""
    model = get_model("wresnet", "tiny")
    inputs = make_inputs(model)
    serial_state, _ = jax.jit(model.train_step)(inputs.state, inputs.batch)
    one, _ = jax.jit(accumulation_step(model, 1))(inputs.state, inputs.batch)
    _close(one, serial_state)
    halves = [jax.tree.map(lambda x, i=i: x[i * 4:(i + 1) * 4], inputs.batch) for i in (0, 1)]
    stats = [jax.jit(model.train_step)(inputs.state, half)[0]["batch_stats"] for half in halves]
    two, _ = jax.jit(accumulation_step(model, 2))(inputs.state, inputs.batch)
    assert model.config.batch_size == 8
    _close(two["batch_stats"], jax.tree.map(lambda a, b: (a + b) / 2, *stats))
    # and not the whole batch's (a variance is not the mean of its halves' variances)
    with pytest.raises(AssertionError):
        _close(two["batch_stats"], serial_state["batch_stats"])


def test_under_jit_from_a_stage_plans_layouts_it_keeps_them_and_reduces_the_gradient():
    model = get_model("mlp", "tiny")
    devices = jax.devices()[:8]
    cluster = local_cluster(devices)
    step = dispatch.trace(model.train_step, model.abstract_inputs(),
                          autopar.ShardParallel(), (1,))
    plan = dispatch.plan(step, cluster).plan
    inputs = make_inputs(model)
    hand = jit_accumulation(model, 4, plan, inputs, devices)
    assert hand.hlo_collectives["all-reduce"]["count"] >= 1
    state, loss = hand.jitted(hand.state, inputs.batch)
    serial_state, serial_loss = jax.jit(model.train_step)(inputs.state, inputs.batch)
    _close(loss, serial_loss)
    _close(state, serial_state)
    # the new state comes back as the old went in: the next step takes it as it is
    assert jax.tree.map(lambda a: a.sharding, state) == jax.tree.map(
        lambda a: a.sharding, hand.state)


def test_a_batch_that_does_not_split_evenly_is_refused():
    model = get_model("mlp", "tiny")
    inputs = make_inputs(model)
    with pytest.raises(InvalidOptionError, match="equal microbatches"):
        accumulation_step(model, 3)(inputs.state, inputs.batch)
    with pytest.raises(InvalidOptionError, match="at least 1"):
        accumulation_step(model, 0)
