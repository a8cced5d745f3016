"""The pipeline runtime on a step with everything around the loss: batch preprocessing before
it, aux outputs, a long skip connection, user-marked layers, stages of unequal submeshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.compiler.planners.pipeshard import plan_pipeshard
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.runtime.local_cluster import local_cluster
from autopar.runtime.pipeline import PipelineRunner

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

OPT = optax.adam(1e-2, eps=1e-3)


def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["w1"])
    g = jnp.sin(h)
    h, g = autopar.mark_pipeline_boundary(h, g)
    h2 = jnp.tanh(g @ p["w2"]) + g
    h2 = autopar.mark_pipeline_boundary(h2)
    out = (jnp.tanh(h2 @ p["w3"]) + h) @ p["w4"]  # h skips the middle stage
    return jnp.mean((out - y) ** 2), {"mean_h": jnp.mean(h)}


def make_step(value_and_grad):
    def step(state, batch):
        x = batch["x"] * 2.0 - 1.0  # computed from the batch before the loss function
        (loss, aux), grads = value_and_grad(loss_fn, has_aux=True)(state["p"], x, batch["y"])
        updates, opt_state = OPT.update(grads, state["o"], state["p"])
        return {"p": optax.apply_updates(state["p"], updates), "o": opt_state}, (loss, aux)

    return step


def inputs():
    k = jax.random.split(jax.random.key(0), 6)
    shapes = {"w1": (8, 16), "w2": (16, 16), "w3": (16, 16), "w4": (16, 4)}
    p = {name: jax.random.normal(key, shape) * 0.3
         for key, (name, shape) in zip(k[:4], shapes.items(), strict=True)}
    batch = {"x": jax.random.uniform(k[4], (32, 8)), "y": jax.random.normal(k[5], (32, 4))}
    return {"p": p, "o": OPT.init(p)}, batch


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_skip_connection_goes_straight_and_numbers_equal_serial(schedule):
    state, batch = inputs()
    step = make_step(autopar.value_and_grad)
    method = autopar.PipeshardParallel(
        num_microbatches=4, layers="marked", schedule=schedule,
        stages=autopar.ManualStages(((0, 1), (1, 2), (2, 3)), ((1, 2), (1, 4), (1, 2))))
    pp = build_pipeline_program(step, (state, batch), (1,), 4)
    plan = plan_pipeshard(pp, method, local_cluster())
    assert [len(s.device_ids) for s in plan.stages] == [2, 4, 2]
    runner = PipelineRunner.from_plan(pp, plan, jax.devices())
    first, middle, last = runner.pieces
    skipped = set(first.outputs) & set(last.inputs)
    # h goes from the first stage to the last directly: the middle stage neither reads nor
    # relays it
    assert skipped and not skipped & (set(middle.inputs) | set(middle.outputs))

    ref = jax.jit(make_step(jax.value_and_grad))
    a = b = state
    for _ in range(3):
        a, (la, aux_a) = ref(a, batch)
        out = runner(jax.tree_util.tree_leaves((b, batch)))
        b, (lb, aux_b) = jax.tree_util.tree_unflatten(pp.outer.out_tree, out)
        assert float(lb) == pytest.approx(float(la), rel=1e-5)
        assert float(aux_b["mean_h"]) == pytest.approx(float(aux_a["mean_h"]), rel=1e-4, abs=1e-6)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=2e-5)
