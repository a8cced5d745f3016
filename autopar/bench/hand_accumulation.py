"""Gradient accumulation written by hand: the reference a one-stage pipeline's time is judged
by.

A one-stage pipeline with ``m`` microbatches does the work of gradient accumulation: the
batch cut into ``m`` equal microbatches along axis 0, each one's loss and gradient computed
in turn, their means applied by the optimizer once. ShardParallel on the whole batch does
less (each op once, on the whole batch), so pipeline / ShardParallel mixes what the runtime
costs with what the split itself costs on the devices. This module writes the split the way
a user writes it without autopar (``lax.scan`` over the microbatches, summing the loss, the
loss's aux results and the gradients, as MaxText and Levanter accumulate) and compiles it
with ``jax.jit`` from the input layouts of the same stage run by ShardParallel (planned on
the whole batch), XLA's propagation placing the rest. Pipeline / this is what autopar's
runtime and its stage plan cost beyond the same work written by hand.

It is written against the zoo's model API (loss and optimizer), not derived from a plan:
the numerics are the pipeline's (``docs/pipeline.md``: loss, aux results and gradients are
the microbatches' means), which ``tests/bench/test_hand_accumulation.py`` checks against the
serial step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.errors import InvalidOptionError
from autopar.models import ZooModel
from autopar.plan import Plan

__all__ = ["HandStep", "accumulation_step", "jit_accumulation"]

def accumulation_step(model: ZooModel, microbatches: int) -> Callable[[Any, Any], Any]:
    """``step(state, batch) -> (new_state, loss)``: one Adam step of ``model`` on the mean of
    ``microbatches`` microbatches' gradients, accumulated by ``lax.scan``; the loss and the
    new extra state (batch statistics) are the microbatches' means."""
    import jax
    import jax.numpy as jnp
    import optax

    if microbatches < 1:
        raise InvalidOptionError(f"microbatches must be at least 1, got {microbatches}")
    family, config = model.family, model.config

    def step(state: Any, batch: Any) -> Any:
        params = state["params"]
        extra = model.extra_state(state)
        for leaf in jax.tree.leaves(batch):
            if leaf.shape[0] % microbatches:
                raise InvalidOptionError(
                    f"the batch's leading dimension {leaf.shape[0]} does not split into "
                    f"{microbatches} equal microbatches")
        cut = jax.tree.map(
            lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]), batch)

        def one(micro: Any) -> Any:
            loss_with_extra = family.loss_with_extra
            if loss_with_extra is None:
                loss, grads = jax.value_and_grad(model.loss_fn)(params, micro)
                return loss, extra, grads
            (loss, new_extra), grads = jax.value_and_grad(
                lambda p: loss_with_extra(p, extra, micro, config), has_aux=True)(params)
            return loss, new_extra, grads

        def add(total: Any, micro: Any) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, total, one(micro)), None

        shapes = jax.eval_shape(one, jax.tree.map(lambda x: x[0], cut))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total, _ = jax.lax.scan(add, zeros, cut)
        loss, new_extra, grads = jax.tree.map(lambda x: x / microbatches, total)
        updates, opt_state = model.optimizer.update(grads, state["opt_state"], params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
                **new_extra}, loss

    return step


@dataclass(frozen=True)
class HandStep:
    """A step compiled outside autopar, ready to be timed as a training loop calls it: the
    jitted function, the state already in its input layout, and the collectives XLA emitted
    (by kind, as ``ParallelizedStep.get_hlo_collectives`` counts them)."""

    jitted: Callable
    state: Any
    hlo_collectives: dict[str, dict[str, int]]


def jit_accumulation(model: ZooModel, microbatches: int, stage_plan: Plan, inputs: Any,
                     devices: Sequence[Any]) -> HandStep:
    """:func:`accumulation_step` under ``jax.jit`` with the inputs of ``stage_plan``'s one
    stage in its layouts (new state as the old) on its logical mesh of ``devices``."""

    from autopar.bench.hand_oracle import jit_collectives, state_in_layout

    stage = stage_plan.stages[0]
    stage_devices = [devices[i] for i in stage.device_ids]
    args = (inputs.state, inputs.batch)
    summary, jitted = jit_collectives(accumulation_step(model, microbatches), args,
                                      stage.input_shardings, stage_devices,
                                      stage.logical_mesh_shape, stage.axis_names)
    return HandStep(jitted, state_in_layout(jitted, args), summary.by_kind())
