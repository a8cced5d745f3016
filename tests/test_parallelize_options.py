"""The decorator's options on ordinary steps: bare / with arguments / as a call, NamedTuple and
flax.struct state, static and donated arguments, and when a new signature replans."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

import autopar
from autopar.errors import InvalidOptionError

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

OPT = optax.chain(optax.clip_by_global_norm(1.0),
                  optax.adam(optax.exponential_decay(0.05, transition_steps=2, decay_rate=0.5)))


class State(NamedTuple):
    params: dict
    opt: optax.OptState


@struct.dataclass
class StructState:
    params: dict
    opt: optax.OptState
    label: str = struct.field(pytree_node=False, default="run")


def loss_fn(params, batch, scale=1.0):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return scale * jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def update(params, opt, grads):
    updates, opt = OPT.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt


def named_tuple_step(state: State, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return State(*update(state.params, state.opt, grads)), loss


def struct_step(state: StructState, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
    params, opt = update(state.params, state.opt, grads)
    return state.replace(params=params, opt=opt), loss


def scaled_step(state: State, batch, scale: float):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, scale)
    return State(*update(state.params, state.opt, grads)), loss


def params_and_batch(batch_size=16, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    p = {"w1": jax.random.normal(k[0], (8, 32)) * 0.3, "w2": jax.random.normal(k[1], (32, 4))}
    batch = {"x": jax.random.normal(k[2], (batch_size, 8)),
             "y": jax.random.normal(k[3], (batch_size, 4))}
    return p, batch


def assert_trees_close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6)


def three_steps(step, state, *rest):
    for _ in range(3):
        state, loss = step(state, *rest)
    return state, float(loss)


def test_the_three_decorator_forms_give_the_jit_numbers():
    p, batch = params_and_batch()
    state = State(p, OPT.init(p))
    want_state, want_loss = three_steps(jax.jit(named_tuple_step), state, batch)

    @autopar.parallelize
    def bare(state, batch):
        return named_tuple_step(state, batch)

    @autopar.parallelize(method=autopar.ShardParallel(), cache=False)
    def with_arguments(state, batch):
        return named_tuple_step(state, batch)

    called = autopar.parallelize(named_tuple_step, method=autopar.DataParallel(), cache=False)
    for step in (bare, with_arguments, called):
        assert isinstance(step, autopar.ParallelizedStep)
        got_state, got_loss = three_steps(step, state, batch)
        assert isinstance(got_state, State)
        assert got_loss == pytest.approx(want_loss, rel=1e-5)
        assert_trees_close(got_state, want_state)


def test_flax_struct_state_with_a_static_field_keeps_it_and_pipelines():
    p, batch = params_and_batch()
    state = StructState(p, OPT.init(p), label="exp-1")
    want_state, want_loss = three_steps(jax.jit(struct_step), state, batch)
    step = autopar.parallelize(struct_step, cache=False, method=autopar.PipeshardParallel(
        num_microbatches=2, stages="uniform", num_stages=2))
    got_state, got_loss = three_steps(step, state, batch)
    assert got_state.label == "exp-1"
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert_trees_close(got_state, want_state)


def test_static_arguments_are_part_of_the_signature():
    p, batch = params_and_batch()
    state = State(p, OPT.init(p))
    step = autopar.parallelize(scaled_step, method=autopar.ShardParallel(), static_argnums=(2,),
                               cache=False)
    plan_one = step.get_plan(state, batch, 1.0)
    assert step.get_plan(state, batch, 1.0) is plan_one  # same signature: planned once
    assert step.get_plan(state, batch, 3.0) is not plan_one  # another static value replans
    # the static argument is not an input of the plan: its leaves are the state's and batch's
    assert {s.path.split("/")[0] for s in plan_one.signature} == {"state", "batch"}
    for scale in (1.0, 3.0):
        want = three_steps(jax.jit(scaled_step, static_argnums=2), state, batch, scale)
        got = three_steps(step, state, batch, scale)
        assert got[1] == pytest.approx(want[1], rel=1e-5)
        assert_trees_close(got[0], want[0])


def test_a_new_shape_replans_and_the_same_shape_reuses():
    p, batch = params_and_batch(16)
    _, small = params_and_batch(8)
    state = State(p, OPT.init(p))
    step = autopar.parallelize(named_tuple_step, method=autopar.DataParallel(), cache=False)
    first = step.get_plan(state, batch)
    assert step.get_plan(state, batch) is first
    other = step.get_plan(state, small)
    assert other is not first
    assert [s.shape for s in other.signature if s.path == "batch/x"] == [(8, 8)]
    half = {k: v.astype(jnp.float16) for k, v in batch.items()}
    assert step.get_plan(state, half) is not first  # a new dtype replans too
    assert step.get_plan(state, dict(batch)) is first


@pytest.mark.parametrize("method", [autopar.ShardParallel(), autopar.PipeshardParallel(
    num_microbatches=2, stages="uniform", num_stages=2)], ids=["shard", "pipeshard"])
def test_donated_state_is_consumed_and_the_numbers_stay(method):
    p, batch = params_and_batch()
    fresh = lambda: StructState(*jax.tree_util.tree_map(jnp.array, (p, OPT.init(p))))  # noqa: E731
    want_state, want_loss = jax.jit(struct_step)(fresh(), batch)
    step = autopar.parallelize(struct_step, method=method, donate_argnums=(0,), cache=False)
    state = fresh()
    got_state, got_loss = step(state, batch)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_trees_close(got_state, want_state)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(state))
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(batch))
    if isinstance(method, autopar.ShardParallel):
        # XLA was told: the compiled program aliases donated inputs to outputs
        assert "input_output_alias" in step.get_hlo_text(got_state, batch)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"static_argnums": (0,), "donate_argnums": (0,)}, "both static_argnums and donate_argnums"),
    ({"static_argnums": (-1,)}, "static_argnums=(-1,) must be non-negative"),
    ({"cache": 3}, "cache= takes True, False or a directory"),
])
def test_contradictory_options_get_one_line(kwargs, fragment):
    with pytest.raises(InvalidOptionError) as err:
        autopar.parallelize(named_tuple_step, **kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_static_argument_errors_are_one_line():
    p, batch = params_and_batch()
    state = State(p, OPT.init(p))
    with pytest.raises(InvalidOptionError, match="both static_argnums and batch_argnums"):
        autopar.parallelize(scaled_step, static_argnums=(1,), batch_argnums=(1,))
    unhashable = autopar.parallelize(scaled_step, static_argnums=(2,), cache=False)
    with pytest.raises(InvalidOptionError, match="unhashable type list"):
        unhashable(state, batch, [1.0])
    beyond = autopar.parallelize(scaled_step, static_argnums=(5,), cache=False)
    with pytest.raises(InvalidOptionError, match="names argument 5"):
        beyond(state, batch, 1.0)


def test_a_step_returning_a_non_array_gives_it_back():
    """Non-array output leaves are static (as with eqx.filter_jit): returned as traced."""
    p, batch = params_and_batch()

    def chatty(params, batch):
        return params, "done"

    step = autopar.parallelize(chatty, method=autopar.DataParallel(), cache=False)
    got, word = step(p, batch)
    assert word == "done"
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(p)
