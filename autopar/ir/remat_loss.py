"""Rematerialised ``autopar.value_and_grad`` for one-stage plans.

With ``remat="layers"`` the loss function's forward is cut into layers (the planner chooses
the cut positions: the user's ``mark_pipeline_boundary`` calls, else clustering) and each layer
runs under ``jax.checkpoint``: the backward keeps only every layer's inputs and recomputes the
rest. The forward used here is the same flat program the pipeline pass cuts
(``flatten_jaxpr`` of the loss jaxpr, markers kept), so the positions index the same equations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar.ir.flatten import StepJaxpr, flatten_jaxpr, flatten_step
from autopar.ir.loss_markers import LossFunction
from autopar.ir.pipeline_pieces import cut_pieces
from autopar.ir.program import FlatProgram, run_eqns


def loss_forward(loss: LossFunction) -> FlatProgram:
    """The loss function's forward as a flat program: closed-over values, then arguments."""
    paths = [f"loss/const{i}" for i in range(loss.num_consts)] + [
        f"loss/arg{i}" for i in range(loss.num_args)
    ]
    return flatten_jaxpr(loss.jaxpr, paths, keep_markers=True)


def rematerialised_value_and_grad(
    loss: LossFunction, positions: Sequence[int]
) -> Callable[..., list[Any]]:
    """[loss, *aux, *grads] like ``loss.value_and_grad``, each layer of the forward (cut before
    the equations at ``positions``) under ``jax.checkpoint``."""
    forward = loss_forward(loss)
    layers = cut_pieces(forward, list(positions))

    def run_forward(values: list[Any]) -> list[Any]:
        env = dict(zip(forward.in_ids, values, strict=True))
        for layer in layers:
            ins = [v for v in layer.inputs if v in env]
            outs = jax.checkpoint(layer_function(forward, layer, ins))([env[v] for v in ins])
            env.update(zip(layer.outputs, outs, strict=True))
        return [env[v] if v in env else forward.values[v] for v in forward.out_ids]

    def value_and_grad(*operands: Any) -> list[Any]:
        values = list(operands)
        first = loss.num_consts

        def objective(diff_values: list[Any]) -> tuple[Any, list[Any]]:
            full = list(values)
            for i, v in zip(loss.diff_leaves, diff_values, strict=True):
                full[first + i] = v
            out = run_forward(full)
            return out[0], out[1:]

        (value, aux), grads = jax.value_and_grad(objective, has_aux=True)(
            [values[first + i] for i in loss.diff_leaves]
        )
        return [value, *aux, *grads]

    return value_and_grad


def layer_function(forward: FlatProgram, layer: Any, inputs: Sequence[int]) -> Callable:
    """One layer (a ``Piece`` of ``forward``) as a function from its ``inputs``' values to its
    outputs' values: what ``jax.checkpoint`` wraps."""

    def run(values: list[Any]) -> list[Any]:
        env = dict(zip(inputs, values, strict=True))
        run_eqns(forward, layer.eqns, env)
        return [env[v] for v in layer.outputs]

    return run


def flatten_step_rematerialised(fn: Callable, args: Sequence[Any], positions: Sequence[int],
                                jaxpr: StepJaxpr | None = None) -> FlatProgram:
    """``program.flatten_step`` with ``autopar.value_and_grad`` inlined in its rematerialised
    form: each layer of the loss forward (cut before the equations at ``positions`` of
    ``loss_forward``) under ``jax.checkpoint``. ``jaxpr``: the step already traced at these
    shapes (``flatten.trace_jaxpr``)."""
    return flatten_step(fn, args,
                        expand_loss=lambda loss: rematerialised_value_and_grad(loss, positions),
                        jaxpr=jaxpr)
