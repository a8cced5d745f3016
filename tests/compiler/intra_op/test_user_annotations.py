"""Scanned layers as LLM code writes them: activations named with ``checkpoint_name`` under a
policy that saves some, parameters committed to the user's own 2-D mesh, and the model's own
``with_sharding_constraint`` on its activations. ShardParallel plans the layouts: its run
gives the serial numbers and XLA communicates what it does for the same model without names,
commitments and constraints (the constraints, replayed, made XLA reshard around them)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest  # noqa: E402
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

LAYERS, WIDTH, BATCH = 4, 64, 32
OPT = optax.sgd(0.1)  # Adam turns rounding in a near-zero gradient into a full step


def make_step(mesh=None):
    annotated = mesh is not None
    name = checkpoint_name if annotated else (lambda x, _: x)

    def constrain(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)) if annotated else x

    def layer(h, p):
        a = name(jnp.tanh(h @ p["w1"]), "mlp_hidden")
        a = constrain(a, P("data", None))
        return h + name(a @ p["w2"], "mlp_out"), None

    policy = jax.checkpoint_policies.save_only_these_names("mlp_out")

    def loss_fn(params, batch):
        h = constrain(batch["x"], P("data", None))
        h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), h, params["layers"])
        return jnp.mean((h @ params["head"] - batch["y"]) ** 2)

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["p"], batch)
        updates, opt = OPT.update(grads, state["o"], state["p"])
        return {"p": optax.apply_updates(state["p"], updates), "o": opt}, loss

    return step


def inputs():
    k = jax.random.split(jax.random.key(0), 5)
    params = {"layers": {"w1": jax.random.normal(k[0], (LAYERS, WIDTH, 4 * WIDTH)) * 0.05,
                         "w2": jax.random.normal(k[1], (LAYERS, 4 * WIDTH, WIDTH)) * 0.05},
              "head": jax.random.normal(k[2], (WIDTH, 8)) * 0.1}
    batch = {"x": jax.random.normal(k[3], (BATCH, WIDTH)),
             "y": jax.random.normal(k[4], (BATCH, 8))}
    return {"p": params, "o": OPT.init(params)}, batch


def test_the_models_own_annotations_change_neither_numbers_nor_communication():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    state, batch = inputs()
    committed = jax.device_put(state, NamedSharding(mesh, P()))
    method = autopar.ShardParallel(mesh_shape=(2, 4))
    annotated = autopar.parallelize(make_step(mesh), method=method, cache=False)
    plain = autopar.parallelize(make_step(), method=method, cache=False)

    new_state, loss = annotated(committed, batch)
    want_state, want_loss = jax.jit(make_step())(state, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)

    got = annotated.get_hlo_collectives(committed, batch)
    want = plain.get_hlo_collectives(state, batch)
    assert want["all-reduce"]["count"] > 0  # the comparison is of a step that communicates
    for kind, counted in want.items():
        assert got[kind]["count"] == counted["count"], (kind, got, want)
        assert abs(got[kind]["bytes"] - counted["bytes"]) <= 0.05 * counted["bytes"], kind
    notes = annotated.get_plan(committed, batch).notes
    assert any("with_sharding_constraint call(s) run as plain copies" in n for n in notes), notes
