"""Small steps written with ``jax.lax.scan`` in the ways that stress scan regions: nested
scans, control flow inside a body, a reversed scan, carries and xs passed straight through, a
scan from a literal carry."""

import jax
import jax.numpy as jnp
import optax


def nested_and_odd_loss(p, b):
    """A scan nesting a scan, a cond and a fori_loop in its body, a reversed scan passing its
    carry through and xs on to ys, and a scan from a literal carry."""
    def layer(carry, w):
        h, i = carry
        h = jax.lax.cond(i % 2 == 0, lambda v: jnp.tanh(v @ w), lambda v: jax.nn.relu(v @ w), h)
        h = jax.lax.fori_loop(0, 2, lambda _, v: v * 0.9 + 0.1, h)
        h, _ = jax.lax.scan(lambda v, _: (v * 0.5 + jnp.sin(v), None), h, None, length=2)
        return (h, i + 1), h.mean(axis=1)

    (h, _), means = jax.lax.scan(layer, (b["x"], 0), p["w"], reverse=True)
    seq = b["seq"].transpose(1, 0, 2)  # [batch, 3, 8] -> [3, batch, 8]
    same, (twice, proj) = jax.lax.scan(lambda c, xs: (c, (xs[0] * 2.0, c @ xs[1])), h,
                                       (seq, p["w"]))
    total, _ = jax.lax.scan(lambda c, m: (c + m.sum(), None), 0.0, means)
    return jnp.mean(proj ** 2) + jnp.mean(twice) + jnp.mean(same) + 1e-3 * total


def odd_args(batch: int = 8):
    """``(params, batch)`` for ``nested_and_odd_loss``."""
    k = jax.random.split(jax.random.key(0), 3)
    return ({"w": jax.random.normal(k[0], (3, 8, 8)) * 0.3},
            {"x": jax.random.normal(k[1], (batch, 8)),
             "seq": jax.random.normal(k[2], (batch, 3, 8))})


def odd_train_step():
    """``(train_step, state, batch)``: Adam on ``nested_and_odd_loss``."""
    opt = optax.adam(1e-2, eps=1e-3)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(nested_and_odd_loss)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss

    params, batch = odd_args()
    return train_step, {"params": params, "opt": opt.init(params)}, batch


def stack_layer(h, w):
    """One layer of a stack: the row-split second kernel wants ``h`` split on its last dim,
    the residual whole."""
    return h + jnp.tanh(h @ w["a"]) @ w["b"]


def unrolled_stack(h, w):
    """Four ``stack_layer`` layers, each sliced out of the stacked weights by hand."""
    for i in range(4):
        h = stack_layer(h, {"a": w["a"][i], "b": w["b"][i]})
    return jnp.sum(h * h)


def scanned_stack(h, w):
    """The same four layers as one ``lax.scan`` over the stacked weights."""
    h, _ = jax.lax.scan(lambda h, w: (stack_layer(h, w), None), h, w)
    return jnp.sum(h * h)


def stack_args():
    """Abstract inputs of the stacks: a batch of 8 of width 256, four layers' weights."""
    sds = jax.ShapeDtypeStruct
    return (sds((8, 256), jnp.float32), {"a": sds((4, 256, 1024), jnp.float32),
                                         "b": sds((4, 1024, 256), jnp.float32)})
