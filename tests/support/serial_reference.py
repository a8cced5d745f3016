"""The reference every parallel run is compared with: the plain single-device ``jax.jit`` step."""

import jax
import numpy as np


def serial_run(model, steps: int) -> tuple[list[float], list[np.ndarray]]:
    """Losses of ``steps`` jitted steps of a zoo model from seed 0 (batches from keys 10, 11,
    ...) and the final state's leaves."""
    state = model.init_state(jax.random.key(0))
    step = jax.jit(model.train_step)
    losses = []
    for i in range(steps):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        losses.append(float(loss))
    return losses, [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
