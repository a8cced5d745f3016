"""Each piece's jitted tasks for a pipelined step (``runtime.pipeline`` drives them).

A piece (virtual stage) of the loss forward gets, on its stage's devices: F (forward; returns
the activations and the residuals the backward needs: the ``jax.vjp`` function's leaves less
the parameters, ``runtime.vjp_residuals``), B (backward to the piece's inputs, from the
parameters and the residuals, adding the parameters' gradients into an accumulator) and, for
zero-bubble schedules, B and W split (input gradients first, weight gradients later); each
backward also in a first-microbatch variant whose gradients become the accumulators. Where
the piece reads parameters as copies (``runtime.param_copies``), ``make_copies`` makes them
once per step, and the tasks take the copies in those parameters' places. Kept apart from the
driver: what a task computes is fixed when the runner is built, while the driver only
decides when each runs and where its values go.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from autopar.ir.cotangent_marks import (
    SUM,
    Sink,
    contraction_key,
    dot_with_held_backward,
    held_contraction,
)
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_pieces import piece_roles
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.remat_loss import layer_checkpoint
from autopar.ir.scan_units import run_forward_eqns
from autopar.runtime.gradient_sinks import GradientSink, fold_into_sinks, plan_sinks
from autopar.runtime.param_copies import ParamCopies, plan_param_copies
from autopar.runtime.shard import partition_spec
from autopar.runtime.vjp_residuals import ResidualLayout


@dataclass
class PieceTasks:
    """One piece's jitted tasks and the forward value ids they take and give."""

    piece: Piece
    stage: int
    diff: list[int]  # inputs differentiated: parameters, then float activations
    params: list[int]  # the parameters among them
    nondiff: list[int]
    float_outputs: list[int]
    other_outputs: list[int]
    forward: Any = None
    backward: Any = None
    backward_input: Any = None
    backward_weight: Any = None
    # the first microbatch's: its gradients become the accumulators (no zeros made, placed
    # and added to)
    backward_first: Any = None
    backward_weight_first: Any = None
    # the copies of the parameters read as copies, in ``params`` order: once per step
    make_copies: Any = None
    # the parameters the forward reads as one copy per batch group (``runtime.param_copies``):
    # their gradients come out and accumulate as per-group partial sums, ``[G, ...]``
    copies: ParamCopies = field(default_factory=ParamCopies)
    # gradient contractions whose partial sums come out per group, ``[*blocks, ...]``, to
    # accumulate after the parameters' gradients (``runtime.gradient_sinks``)
    sinks: list[GradientSink] = field(default_factory=list)


def piece_tasks(pp: PipelineProgram, piece: Piece, stage: int, mesh: Mesh,
                specs: dict[int, Any], remat_layers: Sequence[Piece] = (),
                read_copies: bool = False, selective: bool = False,
                cotangent_specs: dict[int, Any] | None = None,
                contraction_specs: dict[str, Any] | None = None) -> PieceTasks:
    """``piece``'s jitted tasks on ``stage`` (its devices as ``mesh``, ``specs`` its plan's
    forward value id -> ShardingSpec). ``remat_layers``: the forward cut at every layer
    boundary when the stage is rematerialised (empty otherwise): each layer of the piece then
    runs under jax.checkpoint, and the backward keeps only layer inputs. ``read_copies``:
    the parameters whose gradients would be reduced over the batch's axes read as copies
    (``runtime.param_copies``; the caller makes them with ``make_copies`` and passes them in
    those parameters' places), their gradients left for the caller to reduce once per step
    (a stage that is not rematerialised), as are its gradient contractions' partial sums
    where the plan says so (``runtime.gradient_sinks``; recomputed stages too). A recomputed
    layer runs held and bound as the forward is. ``selective``: the
    layers' checkpoints keep their matmuls' outputs (``dots_with_no_batch_dims_saveable``).
    ``cotangent_specs``: the plan's layout of forward values' cotangents where it is not the
    value's own: the backward is held to it there. ``contraction_specs``: where the plan reads
    a contraction's operands, forward and backward, otherwise than they come ("eqn:k:role";
    ``ir.cotangent_marks``)."""
    fwd = pp.forward
    roles = piece_roles(pp, piece)
    diff, params, nondiff = list(roles.diff), list(roles.params), list(roles.nondiff)
    float_out, other_out = list(roles.float_outputs), list(roles.other_outputs)
    t = PieceTasks(piece, stage, diff, params, nondiff, float_out, other_out)
    n_params = len(params)

    inside = set(piece.eqns)
    layers = [layer for layer in remat_layers if layer.eqns and layer.eqns[0] in inside]
    if read_copies:
        _reduce_once_per_step(pp, t, mesh, specs, contraction_specs or {}, layers)
    copies = t.copies
    # the stage plan's layout of what the piece computes: held to it as it is made, so
    # XLA communicates where the plan does (the backward, derived by jax.vjp, follows:
    # a constraint's transpose constrains the cotangent alike)
    made = {v for i in piece.eqns for v in fwd.eqns[i].outputs}
    held = {v: NamedSharding(mesh, partition_spec(specs[v])) for v in made if v in specs}
    # where the plan lays a value's cotangent out otherwise than the value (its backward's
    # own choice: ``ir.cotangent_marks``), the backward is held to that layout instead
    held_back = {v: NamedSharding(mesh, partition_spec(spec))
                 for v, spec in (cotangent_specs or {}).items() if v in held}

    def hold(v: int, x: Any) -> Any:
        if v in copies.copies:
            return jax.lax.with_sharding_constraint(
                x, copies.sharding(mesh, v, specs.get(v), x.ndim - 1))
        if v in held_back:
            return hold_both_ways(x, held[v], held_back[v])
        return jax.lax.with_sharding_constraint(x, held[v]) if v in held else x

    def param_grads(grads: Sequence[Any]) -> list[Any]:
        return [hold(v, g) if v in copies.params else g
                for v, g in zip(params, grads[:n_params], strict=True)]

    checkpoint = layer_checkpoint(selective)
    run = _forward_run(pp, piece, layers, t, hold if held or copies.copies else None,
                       checkpoint, _contraction_bind(mesh, contraction_specs or {}, copies,
                                                     t.sinks))
    _jit_tasks(t, run, param_grads, mesh, specs)
    return t


def _reduce_once_per_step(pp: PipelineProgram, t: PieceTasks, mesh: Mesh,
                          specs: dict[int, Any], contraction_specs: dict[str, Any],
                          layers: Sequence[Piece]) -> None:
    """``t``'s parameters read as copies (``runtime.param_copies``; not with layer scans, nor
    in a recomputed stage)
    and its gradient contractions' sinks (``runtime.gradient_sinks``): what the step reduces
    once, after the last microbatch. Rematerialised (``layers``), a sink's contraction and
    the views it reads its parameter through must be in one layer (each layer is its own
    ``jax.checkpoint``)."""
    fwd, eqns, sizes = pp.forward, t.piece.eqns, dict(mesh.shape)
    if not pp.layer_scans and not layers:
        t.copies = plan_param_copies(fwd, eqns, t.params, t.float_outputs + t.other_outputs,
                                     specs, sizes, _batch_axes(pp, specs))
    sinks = plan_sinks(fwd, eqns, t.params, contraction_specs, t.copies, sizes)
    layer_of = {i: k for k, layer in enumerate(layers) for i in layer.eqns}
    t.sinks = [s for s in sinks
               if len({layer_of.get(i) for i in (s.eqn, *s.chain)}) == 1]


def _contraction_bind(mesh: Mesh, specs: dict[str, Any], copies: ParamCopies,
                      sinks: Sequence[GradientSink]
                      ) -> Callable[[Sequence[Any]], Callable[[Any, Sequence[Any]], Sequence[Any]]]:
    """How the piece's forward binds each equation, given its ``sinks``' values: a
    contraction the plan reads otherwise than its operands come (``specs``, "eqn:k:role"),
    forward or in the transposes that make their gradients, with those reads held
    (``ir.cotangent_marks``), and a parameter's gradient contraction with a sink giving its
    partial sums there; an equation reading parameter copies per group (``copies.bind``);
    the rest as they are."""
    held = {key: NamedSharding(mesh, partition_spec(spec)) for key, spec in specs.items()
            if not key.endswith(f":{SUM}")}
    sunk = {(s.eqn, s.operand): s for s in sinks}
    eqns = {int(key.split(":")[0]) for key in held} | {i for i, _ in sunk}

    def hold_operand(key: tuple, x: Any) -> Any:
        if key[2] == SUM:
            sink = sunk[key[:2]]
            return jax.lax.with_sharding_constraint(
                x, sink.sharding(mesh, x.ndim - len(sink.groups)))
        sharding = held.get(contraction_key(key))
        return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

    def with_sinks(values: Sequence[Any]) -> Callable[[Any, Sequence[Any]], Sequence[Any]]:
        current = list(values)  # each sink, passed through its chain's views so far

        def bind(eqn: Any, operands: Sequence[Any]) -> Sequence[Any]:
            for j, s in enumerate(sinks):
                if eqn.index in s.chain:
                    current[j] = s.through(eqn, current[j])
            if eqn.index not in eqns or any(v in copies.copies for v in eqn.inputs) \
                    or not held_contraction(eqn, operands):
                return copies.bind(eqn, operands)
            mine = {s.operand: Sink(current[j], s.groups)
                    for j, s in enumerate(sinks) if s.eqn == eqn.index}
            return dot_with_held_backward(eqn, operands, copies.bind, hold_operand, mine)

        return bind

    return with_sinks


def _forward_run(pp: PipelineProgram, piece: Piece, layers: Sequence[Piece], t: PieceTasks,
                 hold: Callable[[int, Any], Any] | None, checkpoint: Callable[[Any], Any],
                 binder: Callable[[Sequence[Any]], Callable[[Any, Sequence[Any]], Sequence[Any]]]
                 ) -> Callable[..., tuple[list[Any], list[Any]]]:
    """The piece's forward on its differentiated and other inputs and its sinks' values:
    its float and other outputs. Rematerialised (``layers``), each layer under
    ``jax.checkpoint``; otherwise its equations with what it makes held to the plan's layouts
    (``hold``), bound as ``binder(sinks)`` binds them, a stage's whole units of a layer scan
    run as one shorter scan."""
    fwd = pp.forward

    def run(diff_vals: list[Any], nondiff_vals: list[Any], sinks: Sequence[Any] = ()
            ) -> tuple[list[Any], list[Any]]:
        env = dict(zip(t.diff, diff_vals, strict=True))
        env.update(zip(t.nondiff, nondiff_vals, strict=True))
        if layers:
            for layer in layers:
                ins = [v for v in layer.inputs if v in env]
                outs = checkpoint(_held_layer(fwd, layer, ins, hold, binder))(
                    [env[v] for v in ins], list(sinks))
                env.update(zip(layer.outputs, outs, strict=True))
        else:
            run_forward_eqns(fwd, piece.eqns, env, pp.layer_scans, hold, binder(sinks))
        return [env[v] for v in t.float_outputs], [env[v] for v in t.other_outputs]

    return run


def _held_layer(fwd: Any, layer: Piece, inputs: Sequence[int],
                hold: Callable[[int, Any], Any] | None,
                binder: Callable[[Sequence[Any]], Callable[[Any, Sequence[Any]], Sequence[Any]]]
                ) -> Callable[[list[Any], list[Any]], list[Any]]:
    """``layer`` as a function of its ``inputs``' values and the piece's sinks, its
    equations held and bound as the unrecomputed forward's are (its checkpoint recomputes
    them so too)."""

    def run(values: list[Any], sinks: list[Any]) -> list[Any]:
        env = dict(zip(inputs, values, strict=True))
        run_forward_eqns(fwd, layer.eqns, env, (), hold, binder(sinks))
        return [env[v] for v in layer.outputs]

    return run


def _jit_tasks(t: PieceTasks, run: Callable[..., tuple[list[Any], list[Any]]],
               param_grads: Callable[[Sequence[Any]], list[Any]], mesh: Mesh,
               specs: dict[int, Any]) -> None:
    """``t``'s jitted tasks around ``run``: the forward keeps what the backward needs
    (``ResidualLayout``); the backward variants each a schedule's (the fused one adding into
    the donated accumulators, the split input and weight halves of the zero-bubble
    schedules, and each a first form that makes the accumulators). A piece's accumulators
    are its parameters' gradients, those with a sink folded into it (``runtime.
    gradient_sinks.fold_into_sinks``)."""
    n_params = len(t.params)
    copies = t.copies
    layout = ResidualLayout()

    def forward(diff_vals, nondiff_vals):
        sinks = [s.zeros(mesh) for s in t.sinks]
        outs, vjp_fn, others = jax.vjp(lambda d, s: run(d, nondiff_vals, s), diff_vals, sinks,
                                       has_aux=True)
        return outs, others, layout.split(vjp_fn, diff_vals[:n_params])

    def grads_of(params, residuals, cots):
        """The activations' gradients, and what the step accumulates."""
        grads, sunk = layout.vjp(params, residuals)(cots)
        return grads[n_params:], fold_into_sinks(t.params, param_grads(grads), t.sinks, sunk)

    def backward(params, residuals, cots, acc):
        acts, grads = grads_of(params, residuals, cots)
        return acts, [a + g for a, g in zip(acc, grads, strict=True)]

    def backward_input(params, residuals, cots):
        return grads_of(params, residuals, cots)[0]

    def backward_weight(params, residuals, cots, acc):
        grads = grads_of(params, residuals, cots)[1]
        return [a + g for a, g in zip(acc, grads, strict=True)]

    def backward_first(params, residuals, cots):
        return grads_of(params, residuals, cots)

    def backward_weight_first(params, residuals, cots):
        return grads_of(params, residuals, cots)[1]

    copied = [v for v in t.params if v in copies.params]
    t.make_copies = jax.jit(lambda values: [copies.make(x, v, mesh, specs.get(v))
                                            for v, x in zip(copied, values, strict=True)])
    t.forward = jax.jit(forward)
    t.backward = jax.jit(backward, donate_argnums=(3,))
    t.backward_input = jax.jit(backward_input)
    t.backward_weight = jax.jit(backward_weight, donate_argnums=(3,))
    t.backward_first = jax.jit(backward_first)
    t.backward_weight_first = jax.jit(backward_weight_first)


def _batch_axes(pp: PipelineProgram, specs: dict[int, Any]) -> tuple[str, ...]:
    """The mesh axes the stage plan splits the batch's first dimension over (of the first
    split input it splits so)."""
    for v in sorted(pp.split_inputs):
        spec = specs.get(v)
        if spec is not None and spec.dims and spec.dims[0]:
            return tuple(spec.dims[0])
    return ()


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def hold_both_ways(x: Any, forward: NamedSharding, backward: NamedSharding) -> Any:
    """``x`` held to ``forward``, its cotangent to ``backward`` (where ``jax.lax.
    with_sharding_constraint`` alone holds the cotangent to the value's own layout)."""
    return jax.lax.with_sharding_constraint(x, forward)


def _hold_forward(x: Any, forward: NamedSharding, backward: NamedSharding) -> tuple[Any, None]:
    return jax.lax.with_sharding_constraint(x, forward), None


def _hold_backward(forward: NamedSharding, backward: NamedSharding, _: None,
                   ct: Any) -> tuple[Any]:
    return (jax.lax.with_sharding_constraint(ct, backward),)


hold_both_ways.defvjp(_hold_forward, _hold_backward)
