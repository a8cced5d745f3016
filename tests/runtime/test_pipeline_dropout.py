"""Random numbers in a pipelined loss: per-example draws (dropout) are made once per step for
the whole batch, as the serial step makes them, and cut like the batch, so a pipelined step
with dropout equals the plain ``jax.jit`` step; draws it cannot make so are named in the plan.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from step_runs import assert_same_run, run_steps

import autopar
from autopar.ir.pipeline_program import build_pipeline_program

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

OPT = optax.adam(1e-2, eps=1e-3)
LAYERS, WIDTH, BATCH, KEEP = 4, 16, 32, 0.8


def dropout(x, key):
    return jnp.where(jax.random.bernoulli(key, KEEP, x.shape), x / KEEP, 0.0)


def loss_fn(params, batch, key):
    h = batch["x"]
    for layer, w in enumerate(params["w"]):
        if layer:
            h = autopar.mark_pipeline_boundary(h)
        # a key per layer (folded in inside the loss function); a mask per example
        h = h + dropout(jnp.tanh(h @ w), jax.random.fold_in(key, layer))
    # one key per example, split inside the loss function (its shape is the batch's)
    keys = jax.random.split(jax.random.fold_in(key, LAYERS), h.shape[0])
    h = jax.vmap(lambda k, row: dropout(row, k))(keys, h)
    # noise shared by every example: the same draw at any batch size
    h = h + 0.01 * jax.random.normal(jax.random.fold_in(key, LAYERS + 1), (WIDTH,))
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


def make_step(value_and_grad):
    def step(state, batch):
        # a fresh key every step, from the state (kept as key data: plain numbers to compare)
        rng, key = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        loss, grads = value_and_grad(loss_fn)(state["p"], batch, key)
        updates, opt = OPT.update(grads, state["o"], state["p"])
        return {"p": optax.apply_updates(state["p"], updates), "o": opt,
                "rng": jax.random.key_data(rng)}, loss

    return step


def inputs():
    k = jax.random.split(jax.random.key(0), LAYERS + 3)
    p = {"w": [jax.random.normal(k[i], (WIDTH, WIDTH)) * WIDTH**-0.5 for i in range(LAYERS)],
         "out": jax.random.normal(k[LAYERS], (WIDTH, 2)) * WIDTH**-0.5}
    batch = {"x": jax.random.normal(k[LAYERS + 1], (BATCH, WIDTH)),
             "y": jax.random.normal(k[LAYERS + 2], (BATCH, 2))}
    return {"p": p, "o": OPT.init(p), "rng": jax.random.key_data(jax.random.key(3))}, batch


# one stage too: its tasks on one mesh draw and cut alike
@pytest.mark.parametrize("schedule, stages", [("1f1b", 2), ("zb-h1", 2), ("1f1b", 1)])
def test_pipelined_dropout_equals_the_serial_step(schedule, stages):
    state, batch = inputs()
    method = autopar.PipeshardParallel(num_microbatches=4, layers="marked", num_stages=stages,
                                       stages="uniform", schedule=schedule)
    step = autopar.parallelize(make_step(autopar.value_and_grad), method=method, cache=False)
    plan = step.get_plan(state, batch)
    assert len(plan.stages) == stages and not any("draws anew" in n for n in plan.notes), plan.notes
    assert_same_run(run_steps(step, state, batch),
                    run_steps(jax.jit(make_step(jax.value_and_grad)), state, batch))


def test_each_per_example_draw_leaves_the_forward():
    state, batch = inputs()
    pp = build_pipeline_program(make_step(autopar.value_and_grad), (state, batch), (1,), 4)
    # a draw per layer and the per-example keys' draw; the shared noise stays in the forward
    assert len(pp.draws) == LAYERS + 1 and pp.inexact_draws == ()
    assert {d.bits for d in pp.draws} <= pp.split_inputs
    for d in pp.draws:
        assert d.draw.params["shape"][-1] == WIDTH
        assert pp.forward.avals[d.bits].shape[0] == BATCH // 4
    assert sum(e.name == "random_bits" for e in pp.forward.eqns) == 1  # the shared noise


def scanned_loss(params, batch, key):
    def layer(h, wk):
        w, k = wk
        return h + dropout(jnp.tanh(h @ w), k), None

    keys = jax.random.split(key, params["w"].shape[0])
    h, _ = jax.lax.scan(layer, batch["x"], (params["w"], keys))
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


def test_a_draw_inside_a_scan_stays_per_microbatch_and_the_plan_says_so():
    state, batch = inputs()
    state["p"]["w"] = jnp.stack(state["p"]["w"])
    state["o"] = OPT.init(state["p"])

    def step(state, batch):
        key = jax.random.wrap_key_data(state["rng"])
        loss, grads = autopar.value_and_grad(scanned_loss)(state["p"], batch, key)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state["p"], grads), loss

    pp = build_pipeline_program(step, (state, batch), (1,), 4)
    assert pp.draws == () and any("scan" in why for why in pp.inexact_draws)
    planned = autopar.parallelize(step, method=autopar.PipeshardParallel(
        num_microbatches=4, num_stages=2, stages="uniform", layers=2), cache=False)
    plan = planned.get_plan(state, batch)
    assert any("draws anew" in n and "scan" in n for n in plan.notes), plan.notes
    losses, _ = run_steps(planned, state, batch, steps=1)  # it runs, with its own masks
    assert np.isfinite(losses).all()
