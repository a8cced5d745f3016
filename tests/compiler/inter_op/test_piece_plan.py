"""A pipelined stage plan names a layout for every value its forward computes, including the
values computed after an equation of constants alone (``jnp.where(m, x, -jnp.inf)``'s
literal, which ``jax.vjp`` folds rather than binds): the runtime holds only the values the
plan names, and XLA chose the rest itself (11 all-gathers where MoE's plan has none)."""

import jax
import jax.numpy as jnp
import optax
import pytest  # noqa: E402

import autopar
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def masked_softmax_step():
    """Two dense layers with a masked softmax between them: the mask's fill value is a
    weak-typed literal converted to float32 (an equation of a constant alone)."""
    opt = optax.sgd(0.1)

    def loss_fn(params, batch):
        h = batch["x"] @ params["w1"]
        h = jnp.where(h > 0, h, -jnp.inf)
        p = jax.nn.softmax(jnp.maximum(h, -30.0), axis=-1)
        return jnp.mean((p @ params["w2"] - batch["y"]) ** 2)

    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)), "w2": jax.random.normal(k2, (32, 8))}
    batch = {"x": jax.random.normal(k3, (16, 16)), "y": jnp.zeros((16, 8))}
    return step, {"params": params, "opt": opt.init(params)}, batch


def _results_without_a_layout(step, state, batch) -> list[str]:
    method = autopar.PipeshardParallel(num_microbatches=1, num_stages=1, stages="uniform")
    plan = autopar.parallelize(step, method=method, devices=jax.devices()[:2],
                               cache=False).get_plan(state, batch)
    fwd = build_pipeline_program(step, (state, batch), (1,), 1).forward
    named = plan.stages[0].tensor_shardings
    return [f"{e.index} {e.name}" for e in fwd.eqns for v in e.outputs
            if fwd.avals[v].shape and v not in named]


def test_values_after_a_folded_constant_get_their_layouts():
    step, state, batch = masked_softmax_step()
    assert _results_without_a_layout(step, state, batch) == []


def test_every_value_of_gpts_forward_gets_its_layout():
    model = get_model("gpt", "tiny").with_value_and_grad(autopar.value_and_grad)
    inputs = model.abstract_inputs()
    assert _results_without_a_layout(model.train_step, *inputs) == []
