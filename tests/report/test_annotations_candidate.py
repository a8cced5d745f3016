"""Inputs committed to the user's own mesh are the user's layout: the full search plans it as
one more candidate (their mesh's shape, those inputs pinned, the ILP choosing the rest) and
the report lists it with its estimate beside autopar's plan. ShardParallel's
``pinned_inputs`` is that pin, for anyone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.planners import dispatch
from autopar.errors import InvalidOptionError
from autopar.plan import ShardingSpec
from autopar.report.text import CompileReport
from autopar.runtime.local_cluster import local_cluster

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

OPT = optax.sgd(0.1)


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def step(state, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(state["p"], batch)
    updates, opt = OPT.update(grads, state["o"], state["p"])
    return {"p": optax.apply_updates(state["p"], updates), "o": opt}, loss


def inputs():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (64, 256)) * 0.1,
              "w2": jax.random.normal(k[1], (256, 32)) * 0.1}
    batch = {"x": jax.random.normal(k[2], (32, 64)), "y": jax.random.normal(k[3], (32, 32))}
    return {"p": params, "o": OPT.init(params)}, batch


def committed(state):
    # Megatron's MLP on the user's data x model mesh: w1 by columns, w2 by rows
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    p = state["p"]
    return {"p": {"w1": jax.device_put(p["w1"], NamedSharding(mesh, P(None, "model"))),
                  "w2": jax.device_put(p["w2"], NamedSharding(mesh, P("model", None)))},
            "o": state["o"]}


@pytest.fixture(scope="module")
def annotated_plan():
    state, batch = inputs()
    args = (committed(state), batch)
    planned = dispatch.plan(dispatch.trace(step, args, autopar.AutoParallel(), (1,)),
                            local_cluster())
    return planned, args


def test_the_users_layout_is_a_candidate_with_its_estimate(annotated_plan):
    planned, args = annotated_plan
    plan = planned.plan
    row = next(r for r in plan.planning.candidates if r["name"] == "annotations 2x4")
    assert row["est_step_time_s"] > 0 and row["fits"]
    # planned with the user's specs pinned (data -> x, model -> y): its plan keeps them
    theirs = planned.candidates["annotations 2x4"].plan.stages[0].input_shardings
    assert theirs["state/p/w1"] == ShardingSpec(((), ("y",)))
    assert theirs["state/p/w2"] == ShardingSpec((("y",), ()))
    note = plan.notes[1]
    assert note.startswith("your annotations (the inputs committed to your data x model mesh")
    assert f"est. {row['est_step_time_s']:.4g} s/step" in note
    assert f"autopar's plan: est. {plan.est_step_time_s:.4g} s/step" in note
    text = CompileReport.build("annotated", plan, trace_step(step, args).graph, None, 0.1) \
        .to_text()
    assert "annotations 2x4" in text and "your annotations" in text


def test_the_pinned_layout_is_kept_and_runs_to_the_serial_numbers():
    state, batch = inputs()
    pins = (("state/p/w1", ShardingSpec(((), ("y",)))), ("state/p/w2", ShardingSpec((("y",), ()))))
    method = autopar.ShardParallel(mesh_shape=(2, 4), pinned_inputs=pins)
    parallel = autopar.parallelize(step, method=method, cache=False)
    plan = parallel.get_plan(state, batch)
    for path, spec in pins:
        assert plan.stages[0].input_shardings[path] == spec
    got, loss = parallel(state, batch)
    want, want_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def test_a_pin_on_no_input_is_one_line():
    state, batch = inputs()
    method = autopar.ShardParallel(pinned_inputs=(("state/p/w9", ShardingSpec(((), ()))),))
    with pytest.raises(InvalidOptionError, match="'state/p/w9' is not an input leaf") as err:
        autopar.parallelize(step, method=method, cache=False).get_plan(state, batch)
    assert "\n" not in str(err.value)


def test_uncommitted_inputs_add_no_candidate():
    state, batch = inputs()
    plan = dispatch.plan(dispatch.trace(step, (state, batch), autopar.AutoParallel(), (1,)),
                         local_cluster()).plan
    assert not any(r["name"].startswith("annotations") for r in plan.planning.candidates)
    assert not any("your annotations" in n for n in plan.notes)
