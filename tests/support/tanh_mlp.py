"""A plain JAX + optax train step over dense tanh layers, shared by the planning and the
multi-process tests (and the scripts the latter launch)."""

from collections.abc import Callable

import jax.numpy as jnp
import optax

import autopar


def tanh_mlp_step(opt: optax.GradientTransformation,
                  value_and_grad: Callable = autopar.value_and_grad,
                  metrics: bool = False) -> Callable:
    """``step(state, batch)`` for ``state = {"params": [kernels], "opt": opt_state}`` and
    ``batch = {"x", "y"}``: a mean-squared-error loss through ``tanh(h @ w)`` layers, its
    gradient from ``value_and_grad``, one ``opt`` update. Returns ``(new_state, loss)``, or
    with ``metrics`` ``(new_state, {"loss", "mean_abs_out", "grad_norm"})``: an aux output of
    the loss function and the gradients' global norm (computed after the loss function)."""

    def last(params, batch):
        h = batch["x"]
        for w in params:
            h = jnp.tanh(h @ w)
        return h

    def loss_fn(params, batch):
        return jnp.mean((last(params, batch) - batch["y"]) ** 2)

    def outputs(params, batch):
        h = last(params, batch)
        return jnp.mean((h - batch["y"]) ** 2), jnp.mean(jnp.abs(h))

    def step(state, batch):
        if metrics:
            (loss, mean_abs), grads = value_and_grad(outputs, has_aux=True)(state["params"],
                                                                            batch)
        else:
            loss, grads = value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        new_state = {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}
        if metrics:
            return new_state, {"loss": loss, "mean_abs_out": mean_abs,
                               "grad_norm": optax.global_norm(grads)}
        return new_state, loss

    return step
