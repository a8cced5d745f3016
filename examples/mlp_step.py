"""A small MLP train step in pure JAX + optax, for ``autopar compile``.

    autopar compile examples/mlp_step.py:make_step                       # the full search
    autopar compile examples/mlp_step.py:make_step --method shard --mesh 2x4

``make_step()`` returns ``(train_step, (state, batch))`` with real arrays. The loss is
differentiated with ``autopar.value_and_grad`` (``jax.value_and_grad`` that marks where the loss
function is), so the default full search may cut it into pipeline stages. Run this file to
train it for a few steps with ``autopar.parallelize``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autopar

SIZES = (32, 64, 64, 64, 16)  # input, hidden layers, output
BATCH_SIZE = 128
OPTIMIZER = optax.adam(1e-2)


def init_params(rng: np.random.Generator) -> list[dict[str, jax.Array]]:
    """One ``{"w", "b"}`` per dense layer, scaled for unit-variance activations."""
    return [
        {"w": jnp.asarray(rng.standard_normal((n_in, n_out), np.float32) / np.sqrt(n_in)),
         "b": jnp.zeros((n_out,), jnp.float32)}
        for n_in, n_out in zip(SIZES[:-1], SIZES[1:], strict=True)
    ]


def loss_fn(params: list[dict[str, jax.Array]], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error of the MLP (relu between layers) against ``batch["y"]``."""
    h = batch["x"]
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - batch["y"]) ** 2)


def train_step(state: dict, batch: dict[str, jax.Array]) -> tuple[dict, jax.Array]:
    """One Adam step; returns the new state and the loss before it."""
    loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state}, loss


def make_step() -> tuple[object, tuple[dict, dict[str, jax.Array]]]:
    """``(train_step, (state, batch))``: what ``autopar compile FILE.py:make_step`` plans."""
    rng = np.random.default_rng(0)  # NumPy draws: nothing to compile before planning
    params = init_params(rng)
    state = {"params": params, "opt_state": OPTIMIZER.init(params)}
    batch = {
        "x": jnp.asarray(rng.standard_normal((BATCH_SIZE, SIZES[0]), np.float32)),
        "y": jnp.asarray(rng.standard_normal((BATCH_SIZE, SIZES[-1]), np.float32)),
    }
    return train_step, (state, batch)


if __name__ == "__main__":
    step, (state, batch) = make_step()
    parallel_step = autopar.parallelize(step)
    for i in range(3):
        state, loss = parallel_step(state, batch)
        print(f"step {i}: loss {float(loss):.4f}")
