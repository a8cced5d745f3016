"""A train step cut for pipelining: the loss forward in pieces, everything else in segments.

The step is traced with its markers kept (``flatten.flatten_step(keep_markers=True)``): one
``autopar_value_and_grad`` equation holds the loss function. Its forward is flattened on its
own (``forward``), and cut at equation positions into *pieces* (virtual stages); each piece's
backward is derived from it by ``jax.vjp`` at run time. Every other equation of the step (batch
preprocessing before the loss, the optimizer update after it) gets a *home* stage: after the
gradients, the stage holding most of its operands (so each parameter's update runs where the
parameter lives); before them, its first consumer's stage. Equations are then grouped into
*segments* (phase, level, stage) that can run as one jitted function each.

Compiler and runtime both build this from the same trace, so piece and value ids agree. Pure:
abstract shapes in, no devices.

Cutting the forward into pieces, and what each piece's inputs and outputs are to its tasks:
``pipeline_pieces``; grouping the other equations into segments: ``pipeline_segments``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from autopar.errors import BatchSizeError, NoLossFunctionError, PlanError
from autopar.ir.flatten import StepJaxpr, flatten_step, trace_jaxpr
from autopar.ir.loss_markers import (
    PIPELINE_BOUNDARY,
    VALUE_AND_GRAD,
    LossFunction,
    traced_loss,
)
from autopar.ir.program import FlatProgram, TensorKind, run_eqns
from autopar.ir.random_draws import RandomDraw, rewrite_draws
from autopar.ir.scan_split import split_forward, split_step
from autopar.ir.scan_units import LayerScan
from autopar.ir.walk import flatten_jaxpr


@dataclass(frozen=True)
class PipelineProgram:
    """The traced step, its loss forward, and what is split into microbatches."""

    outer: FlatProgram
    vg_index: int
    loss: LossFunction
    forward: FlatProgram
    operand_of: dict[int, int]  # forward input id -> the step value that feeds it
    split_inputs: frozenset[int]  # forward inputs cut into microbatches along axis 0
    diff_inputs: tuple[int, ...]  # forward inputs differentiated, in gradient order
    batch_size: int
    # the loss forward's layer scans, inlined as units (``ir.scan_split``), and the step's
    # equations slicing its stacked inputs (the runtime runs them where the input lies)
    layer_scans: tuple[LayerScan, ...] = ()
    input_splits: frozenset[int] = frozenset()
    # per-example random draws the driver makes once per step for the whole batch (their
    # results are microbatch inputs of the forward), and why any other draw is not
    draws: tuple[RandomDraw, ...] = ()
    inexact_draws: tuple[str, ...] = ()
    # the loss forward's with_sharding_constraint calls, numbered as copies (``flatten``)
    dropped_constraints: int = 0

    @property
    def vg(self) -> Any:
        return self.outer.eqns[self.vg_index]

    @property
    def loss_outputs(self) -> tuple[int, ...]:
        """Forward ids of [loss, *aux]."""
        return tuple(self.forward.out_ids)

    def param_sources(self) -> dict[int, int]:
        """For each differentiated forward input, the step value it is (or is a slice of,
        for a stacked parameter split by ``ir.scan_split``)."""
        sliced = {self.outer.eqns[i].outputs[0]: self.outer.eqns[i].inputs[0]
                  for i in self.input_splits}
        return {f: sliced.get(self.operand_of[f], self.operand_of[f]) for f in self.diff_inputs}

    def boundary_positions(self) -> list[int]:
        """Cut positions after each ``mark_pipeline_boundary`` in the forward."""
        return [e.index + 1 for e in self.forward.eqns if e.name == PIPELINE_BOUNDARY]

    # facts of the step outside the loss, read for the segments of every partition the
    # pipeline search estimates (GPT 1T's update has ~20,000 equations): computed once
    @functools.cached_property
    def after_gradients(self) -> frozenset[int]:
        """The step's equations that depend on the loss function's results."""
        reached = set(self.vg.outputs)
        dependent = set()
        for e in self.outer.eqns[self.vg_index + 1:]:
            if any(i in reached for i in e.inputs):
                reached.update(e.outputs)
                dependent.add(e.index)
        return frozenset(dependent)

    @functools.cached_property
    def driver_eqns(self) -> frozenset[int]:
        """The step's equations the pipeline's driver runs itself, outside every segment: the
        loss function's and the microbatches' cut of the split inputs."""
        return frozenset({self.vg_index, *self.input_splits})

    @functools.cached_property
    def outer_readers(self) -> dict[int, tuple[int, ...]]:
        """For each value of the step, the equations reading it, in order."""
        readers: dict[int, list[int]] = {}
        for e in self.outer.eqns:
            for v in e.inputs:
                readers.setdefault(v, []).append(e.index)
        return {v: tuple(r) for v, r in readers.items()}

    @functools.cached_property
    def outer_value_bytes(self) -> dict[int, float]:
        """Each value of the step's bytes."""
        return {v: float(math.prod(getattr(a, "shape", ()))) * getattr(
                    getattr(a, "dtype", None), "itemsize", 0)
                for v, a in self.outer.avals.items()}

    @functools.cached_property
    def outer_constants(self) -> frozenset[int]:
        """The step's constant and literal values."""
        return frozenset(v for v, kind in self.outer.kinds.items()
                         if kind in (TensorKind.CONST, TensorKind.LITERAL))

    @functools.cached_property
    def outer_producers(self) -> dict[int, int]:
        """For each value an equation of the step makes, that equation."""
        return {v: e.index for e in self.outer.eqns for v in e.outputs}

    def grad_outputs(self) -> dict[int, int]:
        """Step value id of each differentiated forward input's gradient."""
        first = 1 + self.loss.num_aux
        return {
            fid: self.vg.outputs[first + k] for k, fid in enumerate(self.diff_inputs)
        }


def _loss_eqn(program: FlatProgram) -> Any:
    found = [e for e in program.eqns if e.name == VALUE_AND_GRAD]
    if len(found) != 1:
        raise NoLossFunctionError(
            "PipeshardParallel needs the train step to compute its gradients with exactly one "
            f"autopar.value_and_grad or autopar.grad call; found {len(found)}"
        )
    return found[0]


def build_pipeline_program(
    fn: Callable, args: Sequence[Any], batch_argnums: Sequence[int], num_microbatches: int,
    jaxpr: StepJaxpr | None = None,
) -> PipelineProgram:
    """Trace ``fn(*args)`` and find its loss function (raises PlanError when it has none).

    The step is traced twice: with the whole batch (the equations around the loss) and with one
    microbatch (the loss forward the pipeline runs, traced only as far as the loss function
    where that is enough: ``_microbatch_loss``): shapes, and constants such as a mean's
    divisor, are baked into a trace, so the forward must be traced at the size it runs at.
    ``jaxpr``: the step already traced with the whole batch (``flatten.trace_jaxpr``); with
    one microbatch that trace is the microbatch's too."""
    args = tuple(args)
    whole = jaxpr if jaxpr is not None else trace_jaxpr(fn, args)
    outer = flatten_step(fn, args, keep_markers=True, jaxpr=whole)
    vg = _loss_eqn(outer)
    owner = outer.leaf_arg_indices()
    batch_leaves = [vid for vid, a in zip(outer.in_ids, owner, strict=True) if a in batch_argnums]
    sizes = {int(outer.avals[v].shape[0]) for v in batch_leaves if outer.avals[v].shape}
    if len(sizes) != 1:
        raise BatchSizeError(
            "PipeshardParallel needs every batch leaf to share its first dimension (the batch "
            f"size); found {sorted(sizes) or 'none'}"
        )
    batch_size = sizes.pop()
    if num_microbatches < 1 or batch_size % num_microbatches:
        raise BatchSizeError(
            f"num_microbatches={num_microbatches} must divide the batch size {batch_size}"
        )
    micro = batch_size // num_microbatches
    micro_args = [
        jax.tree_util.tree_map(lambda x: _with_first_dim(x, micro), a) if i in batch_argnums else a
        for i, a in enumerate(args)
    ]
    full: LossFunction = vg.params["loss"]
    loss, small_constant = _microbatch_loss(fn, micro_args, outer, vg, micro < batch_size)
    if (loss.num_consts, loss.num_args, loss.diff_leaves) != (
        full.num_consts, full.num_args, full.diff_leaves
    ):
        raise PlanError(
            "the loss function's inputs change with the batch size; PipeshardParallel needs the "
            "same closed-over values and arguments for the whole batch and for one microbatch"
        )
    if small_constant is not None:
        vg = _take_microbatch_constants(outer, vg, loss, small_constant)
    paths = [f"loss/const{i}" for i in range(loss.num_consts)] + [
        f"loss/arg{i}" for i in range(loss.num_args)
    ]
    forward = flatten_jaxpr(loss.jaxpr, paths, keep_markers=True)
    dropped = forward.dropped_constraints
    operand_of = dict(zip(forward.in_ids, vg.inputs, strict=True))

    from_batch = _depends_on(outer, set(batch_leaves))
    split = set()
    for fid, oid in operand_of.items():
        shape, small = tuple(outer.avals[oid].shape), tuple(forward.avals[fid].shape)
        if oid not in from_batch:
            continue
        if not shape or shape[0] != batch_size or small != (micro, *shape[1:]):
            raise PlanError(
                f"a value computed from the batch enters the loss function with shape "
                f"{shape}: its first dimension is not the batch size {batch_size}, so it "
                "cannot be cut into microbatches"
            )
        split.add(fid)
    consts = loss.num_consts
    diff = tuple(forward.in_ids[consts + i] for i in loss.diff_leaves)
    if split & set(diff):
        raise PlanError("autopar.value_and_grad differentiates a value computed from the batch")
    fwd_in_ids = list(forward.in_ids)  # aligned with the loss equation's operands
    drawn = rewrite_draws(forward, flatten_jaxpr(full.jaxpr, paths, keep_markers=True),
                          frozenset(split), frozenset(diff), micro, batch_size)
    forward = drawn.forward
    layered = split_forward(forward, diff)
    if layered is None:
        draws = _place_draws(outer, drawn.draws, operand_of, split)
        return PipelineProgram(
            outer, vg.index, loss, forward, operand_of, frozenset(split), diff, batch_size,
            draws=draws, inexact_draws=drawn.inexact, dropped_constraints=dropped,
        )
    # scans over stacked layers: inlined, one unit per iteration, the step split to match
    step = split_step(outer, vg.index, fwd_in_ids, layered.slices, diff, 1 + loss.num_aux)
    new_vg = step.program.eqns[step.vg_index]
    forward = layered.forward
    bits = {d.bits for d in drawn.draws}
    operand_of = dict(zip([v for v in forward.in_ids if v not in bits], new_vg.inputs,
                          strict=True))
    diff = tuple(x for fid in diff for x in layered.slices.get(fid, (fid,)))
    draws = _place_draws(step.program, drawn.draws, operand_of, split)
    return PipelineProgram(
        step.program, step.vg_index, loss, forward, operand_of, frozenset(split), diff,
        batch_size, layered.scans, step.input_splits, draws, drawn.inexact, dropped
    )


def _microbatch_loss(fn: Callable, micro_args: Sequence[Any], outer: FlatProgram, vg: Any,
                     smaller: bool) -> tuple[LossFunction, Callable[[int], Any] | None]:
    """The loss function traced at one microbatch (``smaller``: the microbatch is less than
    the batch; else the outer trace's own), and the value of its ``k``-th closed-over
    operand at that size where it is a constant (None: the outer trace's constants stand).

    The step is traced only as far as its loss function (``loss_markers.traced_loss``) when
    every closed-over value the outer trace folds to a constant was concrete there too (the
    zoo's models close over none); else, or where that stops short, the whole step is traced
    at the microbatch's size and its constants folded."""
    if not smaller:
        return vg.params["loss"], None
    full: LossFunction = vg.params["loss"]
    captured = traced_loss(fn, micro_args)
    if captured is not None and len(captured.consts) == full.num_consts and all(
            captured.consts[k] is not None or _folded(outer, vg.inputs[k]) is None
            for k in range(full.num_consts)):
        return captured.loss, captured.consts.__getitem__
    micro_program = flatten_step(fn, micro_args, keep_markers=True)
    micro_vg = _loss_eqn(micro_program)
    return micro_vg.params["loss"], lambda k: _folded(micro_program, micro_vg.inputs[k])


def _take_microbatch_constants(outer: FlatProgram, vg: Any, micro_loss: LossFunction,
                               small_constant: Callable[[int], Any]) -> Any:
    """Give the loss function the closed-over constants of its microbatch trace
    (``micro_loss``; ``small_constant(k)``: the ``k``-th, None where it is not a constant),
    typed as that trace's; returns the loss equation, with fresh constant operands where
    they differ. A constant built from a
    shape (a mean's divisor, ``jnp.prod(jnp.asarray(v.shape))``, or ``jnp.full`` of the batch
    size outside the loss) is baked into each trace, and the forward runs at the microbatch's
    size: the whole batch's value would scale its result silently. The rest of the step keeps
    the whole batch's value."""
    operands = list(vg.inputs)
    for k in range(vg.params["loss"].num_consts):
        whole = _folded(outer, vg.inputs[k])
        small = None if whole is None else small_constant(k)
        if whole is None or small is None or _same_value(whole, small):
            continue
        fresh = max(outer.avals) + 1
        outer.avals[fresh] = micro_loss.jaxpr.constvars[k].aval
        outer.kinds[fresh], outer.values[fresh] = TensorKind.CONST, small
        operands[k] = fresh
    if operands == list(vg.inputs):
        return vg
    outer.eqns[vg.index] = replace(vg, inputs=tuple(operands))
    return outer.eqns[vg.index]


def _same_value(a: Any, b: Any) -> bool:
    """Whether two constants are equal in shape, dtype and every element (PRNG keys by their
    key data)."""
    if a is b:
        return True
    if np.shape(a) != np.shape(b) or getattr(a, "dtype", None) != getattr(b, "dtype", None):
        return False
    if jax.dtypes.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


# Constants computed in the step (``jnp.full(n, batch_size)``) are folded when made by at
# most this many equations; a longer computation from constants alone is left as traced.
FOLD_LIMIT = 32


def _folded(program: FlatProgram, vid: int) -> Any:
    """``vid``'s value when it depends on no step input (a constant, or made from constants
    by at most ``FOLD_LIMIT`` equations), else None."""
    if vid in program.values:
        return program.values[vid]
    if program.kinds.get(vid) == TensorKind.INPUT:
        return None
    producer = {o: e for e in program.eqns for o in e.outputs}
    needed: set[int] = set()
    pending = [vid]
    while pending:
        v = pending.pop()
        if v in program.values:
            continue
        eqn = producer.get(v)
        if eqn is None or len(needed) >= FOLD_LIMIT:
            return None
        if eqn.index not in needed:
            needed.add(eqn.index)
            pending.extend(eqn.inputs)
    env: dict[int, Any] = {}
    run_eqns(program, sorted(needed), env)
    return env[vid]


def _place_draws(outer: FlatProgram, draws: Sequence[RandomDraw], operand_of: dict[int, int],
                 split: set[int]) -> tuple[RandomDraw, ...]:
    """Give each draw a step value of its own for the whole batch's bits (a fresh id: no
    equation of ``outer`` makes it), and make its microbatch bits a loss input cut into
    microbatches from it (``operand_of``, ``split`` updated)."""
    first = max(outer.avals, default=-1) + 1
    placed = []
    for k, d in enumerate(draws):
        source = first + k
        operand_of[d.bits] = source
        split.add(d.bits)
        placed.append(replace(d, source=source))
    return tuple(placed)


def _with_first_dim(leaf: Any, size: int) -> Any:
    shape = tuple(getattr(leaf, "shape", ()))
    if not shape:
        return leaf
    return jax.ShapeDtypeStruct((size, *shape[1:]), leaf.dtype)


def _depends_on(program: FlatProgram, sources: set[int]) -> set[int]:
    reached = set(sources)
    for eqn in program.eqns:
        if any(i in reached for i in eqn.inputs):
            reached.update(eqn.outputs)
    return reached
