"""``jax.ad_checkpoint.checkpoint_name`` labels an activation for a rematerialisation policy
(scanned LLM code names 8-9 per layer): the ``name`` primitive is the identity, so naming an
activation must not change its layout, its numbers or what XLA communicates."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest  # noqa: E402
from jax.ad_checkpoint import checkpoint_name

import autopar

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def make_step(named: bool):
    label = checkpoint_name if named else (lambda x, _: x)

    def loss_fn(params, batch):
        h = label(jnp.tanh(batch["x"] @ params["w1"]), "hidden")
        out = label(h @ params["w2"], "out")
        return jnp.mean((out - batch["y"]) ** 2)

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return step


def inputs():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (64, 128)) * 0.1,
              "w2": jax.random.normal(k[1], (128, 32)) * 0.1}
    batch = {"x": jax.random.normal(k[2], (32, 64)), "y": jax.random.normal(k[3], (32, 32))}
    return params, batch


def test_a_named_activation_keeps_its_layout_and_numbers(caplog):
    params, batch = inputs()
    method = autopar.ShardParallel(mesh_shape=(2, 4))
    with caplog.at_level(logging.WARNING):
        named = autopar.parallelize(make_step(True), method=method, cache=False)
        got_params, got_loss = named(params, batch)
    assert not any("no sharding strategies" in r.getMessage() for r in caplog.records)
    plain = autopar.parallelize(make_step(False), method=method, cache=False)
    want_params, want_loss = jax.jit(make_step(False))(params, batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for k in want_params:
        np.testing.assert_allclose(got_params[k], want_params[k], rtol=1e-5, atol=1e-6)
    # the same plan, and XLA communicates the same, as without the names
    assert named.get_plan(params, batch).stages[0].input_shardings == \
        plain.get_plan(params, batch).stages[0].input_shardings
    assert named.get_hlo_collectives(params, batch) == plain.get_hlo_collectives(params, batch)
