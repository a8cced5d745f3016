"""The loss function's value and gradient traced one distinct layer at a time
(``layered_grad``): the same numbers as JAX's whole-forward ``value_and_grad``, each distinct
block differentiated once, and pieces that differ in a literal or a constant kept apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.ir.flatten import flatten_step, trace_jaxpr
from autopar.ir.layered_grad import block_cuts, layered_value_and_grad, loss_forward
from autopar.ir.loss_markers import VALUE_AND_GRAD, expand_value_and_grad
from autopar.ir.remat_loss import flatten_step_rematerialised
from autopar.models import get_model


def _loss_of(fn, args):
    closed = trace_jaxpr(fn, args).closed
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == VALUE_AND_GRAD]
    return eqn.params["loss"], [v.aval for v in eqn.invars]


def _run(program, args):
    leaves = jax.tree_util.tree_leaves(args)
    return jax.jit(lambda *a: program.evaluate(a))(*leaves)


def _close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-6)


def _gpt_case():
    model = get_model("gpt", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    state = model.init_state(jax.random.PRNGKey(0))
    args = (state, model.make_batch(jax.random.PRNGKey(1)))
    loss, avals = _loss_of(model.train_step, args)
    return model, args, loss, avals


def test_gpt_layers_are_differentiated_once_each():
    _, _, loss, avals = _gpt_case()
    cuts = block_cuts(loss_forward(loss))
    assert cuts is not None and len(cuts) >= 4  # a block per transformer layer at least
    expanded = layered_value_and_grad(loss)
    assert expanded is not None
    traced = jax.make_jaxpr(expanded)(*avals)
    bodies = [e.params["jaxpr"] for e in traced.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    # forward, and backward, of every piece: the four identical blocks share one jaxpr each
    assert len(bodies) > len({id(b) for b in bodies}) + 4


# compiles and runs the steps it compares: the end-to-end tier (the fast tier is -m 'not e2e')
@pytest.mark.e2e
def test_gpt_layered_plain_and_rematerialised_steps_equal_the_whole_forwards():
    model, args, loss, _ = _gpt_case()
    cuts = block_cuts(loss_forward(loss))
    layered = flatten_step(model.train_step, args)
    whole = flatten_step(model.train_step, args, expand_loss=expand_value_and_grad)
    want = _run(whole, args)
    _close(_run(layered, args), want)
    # rematerialised layers of one block, and of two (each block then a shared call inside)
    for positions in (cuts, cuts[1::2]):
        remat = flatten_step_rematerialised(model.train_step, args, positions)
        _close(_run(remat, args), want)


def _step(scales, tables):
    """A loss of layers alike but for the literal each scales by (``scales``) and, with
    ``tables``, a constant array of its own that each adds."""
    consts = [jnp.full((4,), k + 0.5) for k in range(len(scales))]

    def loss_fn(params, x):
        for k, w in enumerate(params):
            h = jnp.tanh(x @ w) * scales[k]
            if tables:
                h = h + consts[k]
            h = h - jnp.mean(h, axis=-1, keepdims=True)
            h = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5)
            x = x + jnp.sin(h)
        return jnp.mean(x ** 2)

    def step(params, x):
        value, grads = autopar.value_and_grad(loss_fn)(params, x)
        return value, [p - 0.1 * g for p, g in zip(params, grads, strict=True)]

    return step


def test_pieces_differing_in_a_literal_or_a_constant_are_not_shared():
    params = [jax.random.normal(jax.random.PRNGKey(k), (4, 4)) for k in range(4)]
    x = jax.random.normal(jax.random.PRNGKey(9), (8, 4))
    for scales, tables in (([1.0, 2.0, 3.0, 4.0], False), ([2.0] * 4, True)):
        step = _step(scales, tables)
        loss, _ = _loss_of(step, (params, x))
        assert block_cuts(loss_forward(loss)) is not None  # the layered form is the one run
        want = jax.tree_util.tree_leaves(jax.jit(step)(params, x))
        _close(_run(flatten_step(step, (params, x)), (params, x)), want)
