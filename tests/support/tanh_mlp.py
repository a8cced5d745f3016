"""A plain JAX + optax train step over dense tanh layers, shared by the planning and the
multi-process tests (and the scripts the latter launch)."""

from collections.abc import Callable

import jax.numpy as jnp
import optax

import autopar


def tanh_mlp_step(opt: optax.GradientTransformation,
                  value_and_grad: Callable = autopar.value_and_grad) -> Callable:
    """``step(state, batch)`` for ``state = {"params": [kernels], "opt": opt_state}`` and
    ``batch = {"x", "y"}``: a mean-squared-error loss through ``tanh(h @ w)`` layers, its
    gradient from ``value_and_grad``, one ``opt`` update. Returns ``(new_state, loss)``."""

    def loss_fn(params, batch):
        h = batch["x"]
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - batch["y"]) ** 2)

    def step(state, batch):
        loss, grads = value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss

    return step
