"""What asynchronous pipeline training must compute, in plain JAX on one device.

Written from the algorithms' definitions (docs/pipeline.md, "Asynchronous pipelines"), not
from autopar's code: a loop over the microbatches of every call, explicit weight versions per
stage, and the optimizer applied as each stage would.

- PipeDream with weight stashing: microbatch ``n`` (numbered from the first call) is a
  minibatch; on stage ``s`` of ``p`` it runs at that stage's weights after ``n - (p - 1 - s)``
  updates (0 while the pipeline fills), and its gradient then updates every stage's state.
  When call ``t`` returns, stage ``s`` has applied the updates of the first
  ``(t + 1) m - (p - 1 - s)`` microbatches (its last ones are still in flight).
- PipeDream-2BW: call ``t``'s ``m`` microbatches all run at version ``t - 1`` (0 for the first
  two calls); the mean of their gradients updates version ``t`` into ``t + 1``. When call
  ``t`` returns the last stage holds version ``t + 1`` and the others still ``t``.

A parameter belongs to one stage (``owner``); every other state leaf goes with the parameter
whose path ends it (Adam's moments) or, with none (the step count), with stage 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _path(keypath: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in keypath)


def _param_owner(params: Any, owner: dict[str, int]) -> Any:
    """The owning stage of each parameter leaf, as a pytree like ``params``."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: owner[_path(kp)], params)


def _snapshot(states: Sequence[Any], owner: dict[str, int]) -> Any:
    """One state from per-stage states: each leaf from the stage holding it."""
    def pick(keypath: Any, *leaves: Any) -> Any:
        path = _path(keypath)
        stage = next((s for p, s in owner.items() if path.endswith(p)), 0)
        return leaves[stage]

    return jax.tree_util.tree_map_with_path(pick, *states)


def _microbatches(batch: dict, m: int) -> list[dict]:
    size = len(next(iter(batch.values()))) // m
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(m)]


def _adam_step(optimizer: optax.GradientTransformation):
    @jax.jit
    def step(state: dict, grads: Any) -> dict:
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    return step


def pipedream_reference(
    loss_fn: Callable, optimizer: optax.GradientTransformation, state: dict,
    batches: Sequence[dict], owner: dict[str, int], num_stages: int, m: int,
) -> tuple[list[float], dict]:
    """Losses of each call and the state the last call returns (PipeDream, stashing)."""
    p = num_stages
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    update = _adam_step(optimizer)
    owners = _param_owner(state["params"], owner)
    history = [[state] for _ in range(p)]  # history[s][v]: stage s's state after v updates
    losses = []
    for t, batch in enumerate(batches):
        call_losses = []
        for k, mb in enumerate(_microbatches(batch, m)):
            n = t * m + k
            read = [history[s][max(0, n - (p - 1 - s))]["params"] for s in range(p)]
            params = jax.tree.map(lambda o, *per_stage: per_stage[o], owners, *read)
            loss, grads = value_and_grad(params, mb)
            call_losses.append(float(loss))
            for s in range(p):  # each stage updates its own copy; only its leaves are kept
                history[s].append(update(history[s][-1], grads))
        losses.append(float(np.mean(call_losses)))
    done = [max(0, len(batches) * m - (p - 1 - s)) for s in range(p)]
    return losses, _snapshot([history[s][done[s]] for s in range(p)], owner)


def pipedream_2bw_reference(
    loss_fn: Callable, optimizer: optax.GradientTransformation, state: dict,
    batches: Sequence[dict], owner: dict[str, int], num_stages: int, m: int,
) -> tuple[list[float], dict]:
    """Losses of each call and the state the last call returns (PipeDream-2BW)."""
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    update = _adam_step(optimizer)
    versions = [state]  # versions[v]: W(v), the same on every stage
    losses = []
    for t, batch in enumerate(batches):
        read = versions[max(0, t - 1)]["params"]
        results = [value_and_grad(read, mb) for mb in _microbatches(batch, m)]
        losses.append(float(np.mean([float(loss) for loss, _ in results])))
        grads = jax.tree.map(lambda *g: jnp.mean(jnp.stack(g), axis=0), *[g for _, g in results])
        versions.append(update(versions[t], grads))
    last = len(batches)
    per_stage = [versions[last] if s == num_stages - 1 else versions[last - 1]
                 for s in range(num_stages)]
    return losses, _snapshot(per_stage, owner)
