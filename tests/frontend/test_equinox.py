"""Equinox models passed whole to the train step: the module's non-array leaves (activation
functions, ints, bools) are static as with ``eqx.filter_jit``, its arrays are traced, and the
updated module comes back with its non-array leaves in place.

An ``eqx.nn.MLP`` and a model whose layers run under ``jax.lax.scan`` (stacked with
``eqx.filter_vmap``, rebuilt with ``eqx.combine`` in the scan body), under ShardParallel and
the default search: loss and every parameter after 3 Adam steps equal ``eqx.filter_jit``'s.
A changed static leaf re-plans and computes with the new value; bad input is one line."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

eqx = pytest.importorskip("equinox")

STEPS = 3
BATCH, IN, WIDTH, OUT = 16, 8, 32, 4
LR = 1e-2
SHARD = autopar.ShardParallel(mesh_shape=(4, 2))
# the default full search, its own choice kept (timing candidates first,
# ``measure_candidates``, is tests/runtime/test_measured_choice.py's subject)
SEARCH = autopar.AutoParallel(measure_candidates=0)
OPT = optax.adam(LR)


class ScannedMLP(eqx.Module):
    """Stacked hidden layers run under ``lax.scan``; ``depth`` and ``activation`` are plain
    (non-array) leaves, static only by the filter_jit rule."""

    embed: eqx.nn.Linear
    layers: eqx.nn.Linear  # every array has a leading layer axis
    head: eqx.nn.Linear
    activation: object
    depth: int

    def __init__(self, key, depth=3, activation=jax.nn.gelu):
        k_in, k_layers, k_out = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(IN, WIDTH, key=k_in)
        make = lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k)  # noqa: E731
        self.layers = eqx.filter_vmap(make)(jax.random.split(k_layers, depth))
        self.head = eqx.nn.Linear(WIDTH, OUT, key=k_out)
        self.activation = activation
        self.depth = depth

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, layer_arrays):
            layer = eqx.combine(layer_arrays, static)
            return self.activation(layer(h)) + h, None

        h, _ = jax.lax.scan(body, self.activation(self.embed(x)), dynamic, length=self.depth)
        return self.head(h)


def make_mlp(activation=jax.nn.relu):
    return eqx.nn.MLP(IN, OUT, WIDTH, 2, activation=activation, key=jax.random.key(0))


def loss_fn(model, batch):
    pred = jax.vmap(model)(batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)


def step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss


def batches():
    out = []
    for i in range(STEPS):
        kx, ky = jax.random.split(jax.random.key(100 + i))
        out.append({"x": jax.random.normal(kx, (BATCH, IN)),
                    "y": jax.random.normal(ky, (BATCH, OUT))})
    return out


def run(fn, model):
    opt_state = OPT.init(eqx.filter(model, eqx.is_array))
    losses = []
    for batch in batches():
        model, opt_state, loss = fn(model, opt_state, batch)
        losses.append(float(loss))
    return model, opt_state, losses


def assert_same(got_model, want_model):
    """Same tree (static leaves included) and the same arrays, at scan numerics' tolerances."""
    got_arrays, got_static = eqx.partition(got_model, eqx.is_array)
    want_arrays, want_static = eqx.partition(want_model, eqx.is_array)
    assert jax.tree_util.tree_structure(got_static) == jax.tree_util.tree_structure(want_static)
    assert jax.tree_util.tree_leaves(got_static) == jax.tree_util.tree_leaves(want_static)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want_arrays)]
    for path, got, want in zip(paths, jax.tree_util.tree_leaves(got_arrays),
                               jax.tree_util.tree_leaves(want_arrays), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                   atol=2e-3 * LR, err_msg=path)


def devices_for(method):
    shape = getattr(method, "mesh_shape", None)
    return jax.devices()[:int(np.prod(shape))] if shape else None


@pytest.mark.parametrize("make_model", [make_mlp, lambda: ScannedMLP(jax.random.key(1))],
                         ids=["mlp", "scanned"])
@pytest.mark.parametrize("method", [SHARD, SEARCH], ids=["shard", "default"])
def test_equinox_step_matches_filter_jit(make_model, method):
    want_model, _, want_losses = run(eqx.filter_jit(step), make_model())
    parallel = autopar.parallelize(step, method=method, batch_argnums=(2,), cache=False,
                                   devices=devices_for(method))
    model = make_model()
    got_model, got_opt_state, got_losses = run(parallel, model)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_same(got_model, want_model)
    # one trace for the 3 steps: the returned module has the same signature as the given one
    traced = parallel.get_traced(got_model, got_opt_state, batches()[0])
    assert traced is parallel.get_traced(model, OPT.init(eqx.filter(model, eqx.is_array)),
                                         batches()[0])
    # the plan names the module's array leaves by their paths; static leaves are no inputs
    in_paths = traced.program.in_paths
    assert any(p.startswith("model/layers/") and p.endswith("/weight") for p in in_paths)
    assert not any("activation" in p or "depth" in p for p in in_paths)


def test_changed_static_leaf_replans_and_uses_the_new_value():
    parallel = autopar.parallelize(step, method=autopar.DataParallel(), batch_argnums=(2,),
                                   cache=False)
    reference = eqx.filter_jit(step)
    batch = batches()[0]
    traces = []
    for activation in (jax.nn.relu, jax.nn.tanh):
        model = make_mlp(activation)
        opt_state = OPT.init(eqx.filter(model, eqx.is_array))
        got_model, _, got_loss = parallel(model, opt_state, batch)
        want_model, _, want_loss = reference(model, opt_state, batch)
        assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-6)
        assert got_model.activation is activation
        assert_same(got_model, want_model)
        traces.append(parallel.get_traced(model, opt_state, batch))
    assert traces[0] is not traces[1]  # traced and planned once per activation
    primitives = [{str(e.primitive) for e in t.program.eqns} for t in traces]
    assert "tanh" in primitives[1] - primitives[0]  # the new activation is in the program


def test_python_scalar_leaves_are_static():
    """A Python int steering Python control flow works (it would fail traced, as under
    ``jax.jit``); a different value is a different signature."""

    def repeat(state, batch):
        y = batch
        for _ in range(state["times"]):
            y = y * state["w"]
        return {"w": state["w"], "times": state["times"]}, y.sum()

    parallel = autopar.parallelize(repeat, method=autopar.DataParallel(), cache=False)
    x = jnp.ones((8, 2))
    sizes = []
    for times in (1, 3):
        state, total = parallel({"w": jnp.float32(2.0), "times": times}, x)
        assert state["times"] == times and isinstance(state["times"], int)
        assert float(total) == 16 * 2.0 ** times
        sizes.append(len(parallel.get_traced(state, x).program.eqns))
    assert sizes[0] < sizes[1]  # the loop unrolled 1 and 3 times: a trace per value


def test_non_array_in_the_batch_is_one_line():
    parallel = autopar.parallelize(step, method=autopar.DataParallel(), batch_argnums=(2,),
                                   cache=False)
    model = make_mlp()
    opt_state = OPT.init(eqx.filter(model, eqx.is_array))
    with pytest.raises(autopar.TraceError) as err:
        parallel(model, opt_state, {"x": batches()[0]["x"], "y": "labels"})
    assert str(err.value) == (
        "batch leaf 'batch/y' is a str ('labels'), not an array; a batch must be a pytree of "
        "arrays (non-array leaves are static only in the other arguments)")


def test_unhashable_static_leaf_is_one_line():
    class Unhashable:
        __hash__ = None

    parallel = autopar.parallelize(step, method=autopar.DataParallel(), batch_argnums=(2,),
                                   cache=False)
    model = eqx.tree_at(lambda m: m.activation, make_mlp(), Unhashable())
    with pytest.raises(autopar.InvalidOptionError) as err:
        parallel(model, (), batches()[0])
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("argument leaf 'model/activation' is a Unhashable, not an "
                                     "array, so it is static and must be hashable")


def test_static_leaf_the_step_cannot_use_is_one_line():
    """A string where the model expects a function fails inside the step: one TraceError."""
    parallel = autopar.parallelize(step, method=autopar.DataParallel(), batch_argnums=(2,),
                                   cache=False)
    model = eqx.tree_at(lambda m: m.activation, make_mlp(), "relu")
    opt_state = OPT.init(eqx.filter(model, eqx.is_array))
    with pytest.raises(autopar.TraceError, match="^could not trace step: TypeError") as err:
        parallel(model, opt_state, batches()[0])
    assert "\n" not in str(err.value)


def test_a_step_already_under_filter_jit_is_parallelized_as_it_is():
    """``parallelize(eqx.filter_jit(step))``: the wrapper's own fields (its function is one
    named ``fn``) are not copied over the parallel step's, and the step gives filter_jit's
    numbers."""
    wrapped = eqx.filter_jit(step)
    want_model, _, want_losses = run(wrapped, make_mlp())
    parallel = autopar.parallelize(wrapped, method=autopar.DataParallel(), batch_argnums=(2,),
                                   cache=False)
    assert parallel.fn is wrapped and parallel.__wrapped__ is wrapped
    got_model, _, got_losses = run(parallel, make_mlp())
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_same(got_model, want_model)
