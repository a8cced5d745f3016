"""Quickstart: a Flax linen model with a TrainState, parallelized by autopar.

Run: python examples/quickstart_flax.py   (8 simulated CPU devices; no accelerator needed)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402

import autopar  # noqa: E402


class MLP(nn.Module):
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(x)


def train_step(state: train_state.TrainState, batch):
    def loss_fn(params, batch):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss


def setup() -> tuple[train_state.TrainState, dict]:
    """The initial train state and the batch."""
    model = MLP()
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(kx, (32, 64)), "y": jax.random.randint(ky, (32,), 0, 10)}
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(kp, batch["x"])["params"],
        tx=optax.adam(optax.cosine_decay_schedule(1e-3, decay_steps=100)))
    return state, batch


def main() -> train_state.TrainState:
    """Three pipelined steps; returns the final state."""
    state, batch = setup()
    step = autopar.parallelize(
        train_step,
        method=autopar.PipeshardParallel(num_microbatches=4),  # or ShardParallel(), ...
        donate_argnums=(0,),  # the old state's buffers are reused, as with jax.jit
    )
    for i in range(3):
        state, loss = step(state, batch)
        print(f"step {i}: loss {float(loss):.6f}")
    plan = step.get_plan(state, batch)
    print(f"plan: {len(plan.stages)} stage(s): "
          + ", ".join(f"layers {s.layers[0]}-{s.layers[-1]} on {len(s.device_ids)} devices"
                      for s in plan.stages))
    return state


if __name__ == "__main__":
    main()
