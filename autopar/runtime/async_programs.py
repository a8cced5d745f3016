"""The jitted programs an asynchronous pipeline runs (``runtime.async_pipeline`` drives them):
each piece's forward, backward and replay, each stage's slice of the update rule, and the
step's other results from the microbatches' losses. Kept apart from the driver: what each
program computes is fixed when the runner is built, while the driver only decides when each
runs and which weight version it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from autopar.ir.async_update import AsyncStepProgram, StageUpdate
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.program import run_eqns
from autopar.ir.scan_units import run_forward_eqns
from autopar.runtime.vjp_residuals import ResidualLayout


def split_reads(prog: AsyncStepProgram,
                u: StageUpdate) -> tuple[list[int], list[int], list[int]]:
    """An update's state reads (its parameters' positions, then the others) and its writes in
    the order of the reads: jax pairs each donated input with the next output of its shape,
    so a state leaf's new value must come where its old value came, or XLA copies."""
    params = {prog.param_position[f] for f in u.params}
    first = [k for k in u.reads if k in params]
    then = [k for k in u.reads if k not in params]
    writes = set(u.writes)
    written = [k for k in first + then if k in writes]
    return first, then, written + [j for j in u.writes if j not in set(written)]


def update_program(pp: PipelineProgram, prog: AsyncStepProgram, stage: int,
                   donate_params: bool, donate_state: bool) -> Any:
    """Stage ``stage``'s update, jitted: ``(params, other_state, grads) -> new values of its
    written state leaves`` (in ``split_reads`` order); the gradients are always donated, the
    parameters and the other state leaves when asked."""
    u, outer = prog.updates[stage], pp.outer
    grad_id = pp.grad_outputs()
    params, others, written = split_reads(prog, u)

    def run(param_vals: list[Any], other_vals: list[Any], grads: list[Any]):
        env = {prog.state_in[k]: x for k, x in zip(params, param_vals, strict=True)}
        env.update((prog.state_in[k], x) for k, x in zip(others, other_vals, strict=True))
        env.update({grad_id[f]: g for f, g in zip(u.grads, grads, strict=True)})
        run_eqns(outer, u.eqns, env)
        return [env[prog.state_out[j]] for j in written]

    donate = (2,) + ((0,) if donate_params else ()) + ((1,) if donate_state else ())
    return jax.jit(run, donate_argnums=donate)


def result_function(pp: PipelineProgram,
                    prog: AsyncStepProgram) -> Callable[[dict[int, Any], list[Any]], list[Any]]:
    """The step's results other than its state, not yet jitted: ``(inputs, losses) ->
    results``, from the step inputs they read (by position) and the microbatches' mean loss
    and aux."""
    outer, vg = pp.outer, pp.vg
    first = 1 + pp.loss.num_aux

    def run(inputs: dict[int, Any], losses: list[Any]) -> list[Any]:
        env = {outer.in_ids[k]: x for k, x in inputs.items()}
        env.update(zip(vg.outputs[:first], losses, strict=True))
        run_eqns(outer, prog.result_eqns, env)
        return [env[v] if v in env else outer.values[v]
                for v in outer.out_ids[prog.num_state:]]

    return run


class AsyncPiecePrograms:
    """A piece's jitted forward and backward for asynchronous schedules.

    ``forward(params, acts, nondiff) -> (outputs, other outputs, residuals)``: the residuals
    of ``jax.vjp`` less the parameters themselves (``runtime.vjp_residuals``);
    ``backward(params, residuals, cots)`` puts the given parameters back and applies the
    vjp. ``replay(params, acts, nondiff, cots)``: forward and vjp at once (the backward
    without stashing)."""

    def __init__(self, pp: Any, t: Any):
        layout = ResidualLayout()

        def run(diff_vals: list[Any], nondiff_vals: list[Any]) -> tuple[list[Any], list[Any]]:
            env = dict(zip(t.diff, diff_vals, strict=True))
            env.update(zip(t.nondiff, nondiff_vals, strict=True))
            run_forward_eqns(pp.forward, t.piece.eqns, env, pp.layer_scans)
            return [env[v] for v in t.float_outputs], [env[v] for v in t.other_outputs]

        def forward(params: list[Any], acts: list[Any], nondiff: list[Any]):
            outs, vjp_fn, others = jax.vjp(lambda d: run(d, nondiff), list(params) + list(acts),
                                           has_aux=True)
            return outs, others, layout.split(vjp_fn, params)

        def backward(params: list[Any], residuals: list[Any], cots: list[Any]) -> list[Any]:
            (grads,) = layout.vjp(params, residuals)(cots)
            return grads

        def replay(params: list[Any], acts: list[Any], nondiff: list[Any], cots: list[Any]):
            _, vjp_fn, _ = jax.vjp(lambda d: run(d, nondiff), list(params) + list(acts),
                                   has_aux=True)
            (grads,) = vjp_fn(cots)
            return grads

        self.forward = jax.jit(forward)
        self.backward = jax.jit(backward)
        self.replay = jax.jit(replay)
