"""The reference every parallel run is compared with: the plain single-device ``jax.jit`` step."""

import jax
import numpy as np

# Runs of zoo models, computed once per test process: many files compare with the serial run of
# the same model (the tiny GPT in the shard, ZeRO and memory tests, the 4-layer GPT in the
# pipeline, remat and memory tests). Keyed by what ``get_model`` builds the step from.
_ZOO_RUNS: dict = {}


def _zoo_key(model, steps: int):
    """The model's identity when it is a zoo model (name, size, config and the value_and_grad
    its step differentiates with determine its ``train_step``, ``init_state`` and
    ``make_batch``), else None: other objects are run every time."""
    from autopar.models.base import ZooModel

    if type(model) is not ZooModel:
        return None
    key = (model.name, model.size, model.config, model.value_and_grad_fn, steps)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def serial_run(model, steps: int) -> tuple[list[float], list[np.ndarray]]:
    """Losses of ``steps`` jitted steps of a zoo model from seed 0 (batches from keys 10, 11,
    ...) and the final state's leaves (read-only: a zoo model's run is shared)."""
    key = _zoo_key(model, steps)
    if key is not None and key in _ZOO_RUNS:
        losses, leaves = _ZOO_RUNS[key]
        return list(losses), list(leaves)
    state = model.init_state(jax.random.key(0))
    step = jax.jit(model.train_step)
    losses = []
    for i in range(steps):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        losses.append(float(loss))
    leaves = [np.array(x) for x in jax.tree_util.tree_leaves(state)]
    for leaf in leaves:
        leaf.setflags(write=False)
    if key is not None:
        _ZOO_RUNS[key] = (tuple(losses), tuple(leaves))
    return losses, leaves


def assert_runner_matches_serial(runner, out_tree, model, steps: int) -> None:
    """``steps`` calls of a pipeline runner (flat inputs in, flat outputs out, unflattened by
    ``out_tree`` into ``(state, loss)``) from seed 0 on the batches of ``serial_run`` give its
    losses and final state (parameters within the update's scale)."""
    import pytest

    ref_losses, ref_leaves = serial_run(model, steps)
    state = model.init_state(jax.random.key(0))
    for i in range(steps):
        batch = model.make_batch(jax.random.key(10 + i))
        out = runner(jax.tree_util.tree_leaves((state, batch)))
        state, loss = jax.tree_util.tree_unflatten(out_tree, out)
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6)
    atol = 2e-3 * model.config.learning_rate
    for want, got in zip(ref_leaves, jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)
