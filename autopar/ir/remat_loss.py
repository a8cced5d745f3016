"""Rematerialised ``autopar.value_and_grad`` for one-stage plans.

With ``remat="layers"`` the loss function's forward is cut into layers (the planner chooses
the cut positions: the user's ``mark_pipeline_boundary`` calls, else clustering) and each layer
runs under ``jax.checkpoint``: the backward keeps only every layer's inputs and recomputes the
rest. The forward used here is the same flat program the pipeline pass cuts
(``layered_grad.loss_forward``: the loss jaxpr flattened, markers kept), so the positions index
the same equations; identical layers share one checkpointed function, which JAX differentiates
once (``layered_grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax

from autopar.ir.flatten import StepJaxpr, flatten_step
from autopar.ir.layered_grad import layered_value_and_grad
from autopar.ir.loss_markers import LossFunction
from autopar.ir.program import FlatProgram

# Selective recomputation (Korthikanti et al. 2022): a layer's checkpoint keeps its matmuls'
# outputs (dots without batch dimensions: the linear maps, not the attention's scores) and
# recomputes the rest; one policy for one-stage plans and pipeline stages alike.
SELECTIVE_POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def layer_checkpoint(selective: bool = False) -> Callable[..., Any]:
    """``jax.checkpoint`` as a recomputed layer runs under: keeping only its inputs, or with
    ``selective`` its matmuls' outputs too (``SELECTIVE_POLICY``)."""
    return partial(jax.checkpoint, policy=SELECTIVE_POLICY) if selective else jax.checkpoint


def rematerialised_value_and_grad(
    loss: LossFunction, positions: Sequence[int], selective: bool = False
) -> Callable[..., list[Any]]:
    """[loss, *aux, *grads] like ``loss.value_and_grad``, each layer of the forward (cut before
    the equations at ``positions``) under ``jax.checkpoint`` (``layer_checkpoint``)."""
    expanded = layered_value_and_grad(loss, list(positions), call=layer_checkpoint(selective))
    assert expanded is not None, "cuts given: always layered"
    return expanded


def flatten_step_rematerialised(fn: Callable, args: Sequence[Any], positions: Sequence[int],
                                jaxpr: StepJaxpr | None = None,
                                selective: bool = False) -> FlatProgram:
    """``program.flatten_step`` with ``autopar.value_and_grad`` inlined in its rematerialised
    form: each layer of the loss forward (cut before the equations at ``positions`` of
    ``loss_forward``) under ``jax.checkpoint`` (keeping its matmuls' outputs with
    ``selective``). ``jaxpr``: the step already traced at these shapes
    (``flatten.trace_jaxpr``)."""
    return flatten_step(fn, args,
                        expand_loss=lambda loss: rematerialised_value_and_grad(loss, positions,
                                                                               selective),
                        jaxpr=jaxpr)
