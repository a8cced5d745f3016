"""parallelize() and its on-disk plan cache: a second process-like step with the same program
takes the plan from disk; a damaged entry is replanned with a warning; cache=False writes none."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.errors import InvalidOptionError
from autopar.frontend.plan_cache import PlanCacheWarning

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

OPT = optax.adam(1e-2)


def loss_fn(p, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)


def step(state, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(state["p"], batch)
    updates, opt = OPT.update(grads, state["o"], state["p"])
    return {"p": optax.apply_updates(state["p"], updates), "o": opt}, loss


def inputs():
    k = jax.random.split(jax.random.key(3), 4)
    p = {"w1": jax.random.normal(k[0], (8, 16)) * 0.3, "w2": jax.random.normal(k[1], (16, 4))}
    batch = {"x": jax.random.normal(k[2], (16, 8)), "y": jax.random.normal(k[3], (16, 4))}
    return {"p": p, "o": OPT.init(p)}, batch


@pytest.mark.parametrize("method", [
    autopar.ShardParallel(mesh_shape=(2, 4)),
    autopar.PipeshardParallel(num_microbatches=2, stages="uniform", num_stages=2),
], ids=["shard", "pipeshard"])
def test_a_second_step_takes_the_plan_from_disk_and_gives_the_same_numbers(method, tmp_path):
    state, batch = inputs()
    first = autopar.parallelize(step, method=method, cache=tmp_path)
    plan = first.get_plan(state, batch)
    assert not first.plan_was_cached(state, batch)
    assert len(list(tmp_path.glob("*.json"))) == 1

    second = autopar.parallelize(step, method=method, cache=tmp_path)
    assert second.plan_was_cached(state, batch)
    cached = second.get_plan(state, batch).to_dict()
    assert cached == plan.to_dict()  # run statistics live on the step, not in the plan
    (a, la), (b, lb) = first(state, batch), second(state, batch)
    assert float(la) == pytest.approx(float(lb), rel=1e-6)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_other_options_or_another_program_miss_the_cache(tmp_path):
    state, batch = inputs()
    autopar.parallelize(step, method=autopar.ShardParallel(), cache=tmp_path).get_plan(state, batch)
    other = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(2, 4)),
                                cache=tmp_path)
    assert not other.plan_was_cached(state, batch)

    def scaled(state, batch):  # the same step with a different constant
        new, loss = step(state, batch)
        return new, 2.0 * loss

    changed = autopar.parallelize(scaled, method=autopar.ShardParallel(), cache=tmp_path)
    assert not changed.plan_was_cached(state, batch)
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_a_damaged_entry_is_replanned_with_a_warning(tmp_path):
    state, batch = inputs()
    method = autopar.ShardParallel()
    autopar.parallelize(step, method=method, cache=tmp_path).get_plan(state, batch)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(entry.read_text()[:200])
    again = autopar.parallelize(step, method=method, cache=tmp_path)
    with pytest.warns(PlanCacheWarning, match="ignoring plan cache entry"):
        assert not again.plan_was_cached(state, batch)
    _, loss = again(state, batch)
    assert np.isfinite(float(loss))
    assert autopar.parallelize(step, method=method, cache=tmp_path).plan_was_cached(state, batch)


def test_cache_false_writes_nothing_and_the_default_honours_the_environment(
        tmp_path, monkeypatch):
    state, batch = inputs()
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "env"))
    autopar.parallelize(step, method=autopar.DataParallel(), cache=False).get_plan(state, batch)
    assert not (tmp_path / "env").exists()
    autopar.parallelize(step, method=autopar.DataParallel()).get_plan(state, batch)
    assert len(list((tmp_path / "env").glob("*.json"))) == 1


def test_an_unusable_cache_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    with pytest.raises(InvalidOptionError) as err:
        autopar.parallelize(step, cache=blocker / "plans")
    assert "is not usable" in str(err.value) and "\n" not in str(err.value)
