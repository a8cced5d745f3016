"""Running a step a few times and comparing two runs: the loss of every step and every leaf of
the final state (used by the Flax and scan tests, which compare with ``jax.jit``)."""

import jax
import numpy as np

STEPS = 3


def run_steps(step, state, *rest, steps=STEPS):
    """``steps`` calls of ``step(state, *rest)``, feeding the state back: (losses, final state)."""
    losses = []
    for _ in range(steps):
        state, loss = step(state, *rest)
        losses.append(float(loss))
    return losses, state


def assert_same_run(got, want):
    """Two ``run_steps`` results agree: losses to 2e-5, state leaves to 2e-4 / 2e-6."""
    (gl, gs), (wl, ws) = got, want
    np.testing.assert_allclose(gl, wl, rtol=2e-5)
    for a, b in zip(jax.tree_util.tree_leaves(gs), jax.tree_util.tree_leaves(ws), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
