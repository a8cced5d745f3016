"""Quickstart: a raw JAX + optax train step, parallelized by autopar.

Run: python examples/quickstart_optax.py   (8 simulated CPU devices; no accelerator needed)
"""

import os

# before JAX starts: simulate 8 devices on the CPU (on a GPU machine, drop this)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402

optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


def init(key, sizes=(64, 256, 256, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    params = [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
              for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]
    return {"params": params, "opt": optimizer.init(params)}


def loss_fn(params, batch):
    x = batch["x"]
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train_step(state, batch):
    # autopar.value_and_grad is jax.value_and_grad that also marks the loss for pipelining
    loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def main() -> tuple[dict, dict]:
    """Three steps parallel and serial; returns both final states."""
    state = init(jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(kx, (32, 64)), "y": jax.random.randint(ky, (32,), 0, 10)}

    step = autopar.parallelize(train_step)  # the full search: stages, submeshes, shardings
    plan = step.get_plan(state, batch)
    print(f"plan: {plan.method}, {len(plan.stages)} stage(s), "
          f"est. step {plan.est_step_time_s * 1e3:.3f} ms")

    serial = jax.jit(train_step)
    a, b = state, state
    for i in range(3):
        a, loss_parallel = step(a, batch)
        b, loss_serial = serial(b, batch)
        print(f"step {i}: loss {float(loss_parallel):.6f} "
              f"(serial jax.jit {float(loss_serial):.6f})")
    plan.save("quickstart-plan.json")  # run it later: autopar.parallelize(..., plan=path)
    print("wrote quickstart-plan.json; see it with: autopar show quickstart-plan.json")
    return a, b


if __name__ == "__main__":
    main()
