"""The tiny training run of the lost-host test (tests/cli/test_launch_recovery.py):
its step, its state before step 1 and each step's batch, shared by the launched script
(``fault_scripts/checkpointed_train.py``) and the test's references."""

from collections.abc import Callable

import jax
import numpy as np
import optax
from tanh_mlp import tanh_mlp_step

WIDTHS = (8, 32, 8)
BATCH = 16  # divides every device count the test runs on (4, then 2)
OPT = optax.adam(1e-2)


def train_step() -> Callable:
    """The plain JAX step, ``step(state, batch) -> (state, loss)``: tanh layers, Adam."""
    return tanh_mlp_step(OPT)


def initial_state() -> dict:
    """The state before step 1 (host arrays, the same on every process)."""
    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((a, b)) * a**-0.5).astype(np.float32)
              for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True)]
    return {"params": params, "opt": OPT.init(params)}


def batch(step: int) -> dict:
    """Step ``step``'s batch (1-based): its own seed, so a resumed run sees the same data."""
    rng = np.random.default_rng(1000 + step)
    return {"x": rng.standard_normal((BATCH, WIDTHS[0])).astype(np.float32),
            "y": rng.standard_normal((BATCH, WIDTHS[-1])).astype(np.float32)}


def abstract_state() -> dict:
    """The state's shapes and dtypes (what a restore target is made from)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype),
                        initial_state())


def flat(state: dict) -> dict[str, np.ndarray]:
    """The state's leaves as numpy, keyed by pytree path (the script's ``final.npz``)."""
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)}
