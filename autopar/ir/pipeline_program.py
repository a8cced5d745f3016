"""A train step cut for pipelining: the loss forward in pieces, everything else in segments.

The step is traced with its markers kept (``program.flatten_step(keep_markers=True)``): one
``autopar_value_and_grad`` equation holds the loss function. Its forward is flattened on its
own (``forward``), and cut at equation positions into *pieces* (virtual stages); each piece's
backward is derived from it by ``jax.vjp`` at run time. Every other equation of the step (batch
preprocessing before the loss, the optimizer update after it) gets a *home* stage: after the
gradients, the stage holding most of its operands (so each parameter's update runs where the
parameter lives); before them, its first consumer's stage. Equations are then grouped into
*segments* (phase, level, stage) that can run as one jitted function each.

Compiler and runtime both build this from the same trace, so piece and value ids agree. Pure:
abstract shapes in, no devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from autopar.errors import BatchSizeError, NoLossFunctionError, PlanError
from autopar.ir.loss_markers import PIPELINE_BOUNDARY, VALUE_AND_GRAD, LossFunction
from autopar.ir.program import FlatProgram, TensorKind, flatten_jaxpr, flatten_step
from autopar.ir.random_draws import RandomDraw, rewrite_draws
from autopar.ir.scan_split import split_forward, split_step
from autopar.ir.scan_units import LayerScan


@dataclass(frozen=True)
class Piece:
    """A contiguous run of forward equations; ``inputs`` are read here and defined elsewhere
    (forward inputs or earlier pieces), ``outputs`` are defined here and read later (or are
    the forward's results)."""

    index: int
    eqns: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class Segment:
    """Step equations outside the loss run together on one stage. ``phase``: "before" the
    pipeline (they do not depend on its results) or "after" it; ``level``: segments of one
    level depend only on lower levels of other stages."""

    phase: str
    level: int
    stage: int
    eqns: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


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
    fn: Callable, args: Sequence[Any], batch_argnums: Sequence[int], num_microbatches: int
) -> PipelineProgram:
    """Trace ``fn(*args)`` and find its loss function (raises PlanError when it has none).

    The step is traced twice: with the whole batch (the equations around the loss) and with one
    microbatch (the loss forward the pipeline runs): shapes, and constants such as a mean's
    divisor, are baked into a trace, so the forward must be traced at the size it runs at."""
    args = tuple(args)
    outer = flatten_step(fn, args, keep_markers=True)
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
    micro_vg = _loss_eqn(flatten_step(fn, micro_args, keep_markers=True))
    loss: LossFunction = micro_vg.params["loss"]
    full: LossFunction = vg.params["loss"]
    if (loss.num_consts, loss.num_args, loss.diff_leaves) != (
        full.num_consts, full.num_args, full.diff_leaves
    ):
        raise PlanError(
            "the loss function's inputs change with the batch size; PipeshardParallel needs the "
            "same closed-over values and arguments for the whole batch and for one microbatch"
        )
    paths = [f"loss/const{i}" for i in range(loss.num_consts)] + [
        f"loss/arg{i}" for i in range(loss.num_args)
    ]
    forward = flatten_jaxpr(loss.jaxpr, paths, keep_markers=True)
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
            draws=draws, inexact_draws=drawn.inexact,
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
        batch_size, layered.scans, step.input_splits, draws, drawn.inexact
    )


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


def cut_pieces(forward: FlatProgram, positions: Sequence[int]) -> list[Piece]:
    """Pieces of ``forward`` cut before each equation index in ``positions``."""
    n = len(forward.eqns)
    cuts = [0, *positions, n]
    if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)) or cuts[-1] != n:
        raise PlanError(
            f"pipeline cut positions {list(positions)} must rise strictly within 1..{n - 1}"
        )
    piece_of: dict[int, int] = {}  # value id -> defining piece
    spans = list(zip(cuts, cuts[1:], strict=False))
    for k, (a, b) in enumerate(spans):
        for e in forward.eqns[a:b]:
            for v in e.outputs:
                piece_of[v] = k
    constant = {v for v, kind in forward.kinds.items()
                if kind in (TensorKind.CONST, TensorKind.LITERAL)}
    read_later: dict[int, int] = {}  # value -> last piece reading it
    reads: list[set[int]] = []
    for k, (a, b) in enumerate(spans):
        here = {i for e in forward.eqns[a:b] for i in e.inputs if i not in constant}
        reads.append(here)
        for v in here:
            read_later[v] = max(read_later.get(v, -1), k)
    results = set(forward.out_ids)
    pieces = []
    for k, (a, b) in enumerate(spans):
        inputs = sorted(v for v in reads[k] if piece_of.get(v, -1) != k)
        outputs = sorted(
            v for v, p in piece_of.items()
            if p == k and (read_later.get(v, -1) > k or v in results)
        )
        pieces.append(Piece(k, tuple(range(a, b)), tuple(inputs), tuple(outputs)))
    return pieces


def stage_scan_iterations(pp: PipelineProgram, pieces: Sequence[Piece],
                          stage_of_piece: Sequence[int]) -> list[int]:
    """How many iterations of the forward's layer scans each stage runs: a unit cut between
    two stages counts for the stage that finishes it."""
    last = {u.stop - 1 for scan in pp.layer_scans for u in scan.units if u.stop > u.start}
    counts = [0] * (max(stage_of_piece, default=-1) + 1)
    for piece in pieces:
        counts[stage_of_piece[piece.index]] += sum(1 for i in piece.eqns if i in last)
    return counts


def input_consumers(pieces: Sequence[Piece]) -> dict[int, list[int]]:
    """For each value read across pieces: the pieces that read it, in order."""
    found: dict[int, list[int]] = {}
    for piece in pieces:
        for v in piece.inputs:
            found.setdefault(v, []).append(piece.index)
    return found


def plan_segments(
    pp: PipelineProgram, pieces: Sequence[Piece], stage_of_piece: Sequence[int]
) -> tuple[list[Segment], dict[int, int]]:
    """Group the step's other equations into segments; returns them (in run order) and the
    home stage of every step value the pipeline produces or consumes."""
    outer = pp.outer
    consumers = input_consumers(pieces)
    producer_piece = {v: p.index for p in pieces for v in p.outputs}
    last_stage = stage_of_piece[-1]
    home: dict[int, int] = {}
    # the pipeline's results: the loss and aux where they are computed, each gradient with
    # the first piece that reads its parameter
    for k, fid in enumerate(pp.loss_outputs):
        piece = producer_piece.get(fid)
        home[pp.vg.outputs[k]] = last_stage if piece is None else stage_of_piece[piece]
    for fid, gid in pp.grad_outputs().items():
        home[gid] = stage_of_piece[consumers.get(fid, [0])[0]]
    # where the pipeline wants each of its operands (the first piece reading it)
    wanted: dict[int, int] = {}
    for fid, oid in pp.operand_of.items():
        stage = stage_of_piece[consumers.get(fid, [0])[0]]
        wanted[oid] = min(wanted.get(oid, stage), stage)

    after = _depends_on_outputs(outer, pp.vg_index)
    eqn_home: dict[int, int] = {}
    skipped = {pp.vg_index, *pp.input_splits}  # run by the driver itself
    for e in outer.eqns:  # after the gradients: follow the operand bytes
        if e.index in skipped or e.index not in after:
            continue
        weight: dict[int, float] = {}
        for v in e.inputs:
            if v in home:
                weight[home[v]] = weight.get(home[v], 0.0) + _nbytes(outer.avals[v]) + 1.0
        if weight:
            eqn_home[e.index] = max(sorted(weight), key=lambda s: weight[s])
            for v in e.outputs:
                home[v] = eqn_home[e.index]
    readers: dict[int, list[int]] = {}
    for e in outer.eqns:
        for v in e.inputs:
            readers.setdefault(v, []).append(e.index)
    out_ids = set(outer.out_ids)
    for e in reversed(outer.eqns):  # the rest: where their first consumer is
        if e.index in skipped or e.index in eqn_home:
            continue
        stages = []
        for v in e.outputs:
            stages += [eqn_home[r] for r in readers.get(v, []) if r in eqn_home]
            if v in wanted:
                stages.append(wanted[v])
            if v in out_ids and not stages:
                stages.append(0)
        eqn_home[e.index] = min(stages) if stages else 0
        for v in e.outputs:
            home[v] = eqn_home[e.index]
    return _group(pp, eqn_home, after), home


def _depends_on_outputs(program: FlatProgram, index: int) -> set[int]:
    reached = set(program.eqns[index].outputs)
    dependent = set()
    for e in program.eqns[index + 1 :]:
        if any(i in reached for i in e.inputs):
            reached.update(e.outputs)
            dependent.add(e.index)
    return dependent


def _group(pp: PipelineProgram, eqn_home: dict[int, int], after: set[int]) -> list[Segment]:
    outer = pp.outer
    made_by: dict[int, int] = {v: e.index for e in outer.eqns for v in e.outputs}
    level: dict[int, int] = {}
    skipped = {pp.vg_index, *pp.input_splits}  # the driver runs them: their results are given
    for e in outer.eqns:
        if e.index in skipped:
            continue
        lv = 0
        for v in e.inputs:
            src = made_by.get(v)
            if src is None or src in skipped or (src in after) != (e.index in after):
                continue
            lv = max(lv, level[src] + (eqn_home[src] != eqn_home[e.index]))
        level[e.index] = lv
    groups: dict[tuple[str, int, int], list[int]] = {}
    for e in outer.eqns:
        if e.index in skipped:
            continue
        phase = "after" if e.index in after else "before"
        groups.setdefault((phase, level[e.index], eqn_home[e.index]), []).append(e.index)
    constant = {v for v, kind in outer.kinds.items()
                if kind in (TensorKind.CONST, TensorKind.LITERAL)}
    used_elsewhere: dict[int, set[tuple]] = {}
    for key, eqns in groups.items():
        for i in eqns:
            for v in outer.eqns[i].inputs:
                used_elsewhere.setdefault(v, set()).add(key)
    needed_outside = set(outer.out_ids) | set(pp.vg.inputs)
    segments = []
    for key in sorted(groups, key=lambda k: (k[0] != "before", k[1], k[2])):
        eqns = groups[key]
        defined = {v for i in eqns for v in outer.eqns[i].outputs}
        inputs = sorted({v for i in eqns for v in outer.eqns[i].inputs} - defined - constant)
        outputs = sorted(
            v for v in defined
            if v in needed_outside or used_elsewhere.get(v, set()) - {key}
        )
        segments.append(
            Segment(key[0], key[1], key[2], tuple(eqns), tuple(inputs), tuple(outputs))
        )
    return segments


def _nbytes(aval: Any) -> float:
    return float(np.prod(aval.shape, dtype=np.float64)) * aval.dtype.itemsize


@dataclass(frozen=True)
class PieceRoles:
    """What each input and output of a piece is to its forward and backward tasks.

    ``params``: differentiated loss inputs (their gradients are accumulated); ``acts``: float
    values from earlier pieces (their gradients flow back); ``fixed``: loss inputs that are
    neither differentiated nor cut into microbatches; ``micro``: the rest (microbatch slices,
    and non-float values from earlier pieces). Outputs: ``float_outputs`` carry cotangents back,
    ``other_outputs`` do not."""

    params: tuple[int, ...]
    acts: tuple[int, ...]
    fixed: tuple[int, ...]
    micro: tuple[int, ...]
    float_outputs: tuple[int, ...]
    other_outputs: tuple[int, ...]

    @property
    def diff(self) -> tuple[int, ...]:
        return self.params + self.acts

    @property
    def nondiff(self) -> tuple[int, ...]:
        return self.fixed + self.micro


def piece_roles(pp: PipelineProgram, piece: Piece) -> PieceRoles:
    """Classify ``piece``'s inputs and outputs (the same way for planning and running)."""
    fwd = pp.forward
    loss_inputs = set(fwd.in_ids)
    diff_inputs = set(pp.diff_inputs)
    params = tuple(v for v in piece.inputs if v in diff_inputs)
    acts = tuple(v for v in piece.inputs if v not in loss_inputs and _is_float(fwd.avals[v]))
    fixed = tuple(
        v for v in piece.inputs
        if v in loss_inputs and v not in diff_inputs and v not in pp.split_inputs
    )
    taken = set(params) | set(acts) | set(fixed)
    micro = tuple(v for v in piece.inputs if v not in taken)
    float_out = tuple(v for v in piece.outputs if _is_float(fwd.avals[v]))
    other_out = tuple(v for v in piece.outputs if v not in set(float_out))
    return PieceRoles(params, acts, fixed, micro, float_out, other_out)


def _is_float(aval: Any) -> bool:
    # jax's issubdtype: a PRNG key's dtype (``key<fry>``) is no numpy dtype, and no float
    return bool(jax.dtypes.issubdtype(aval.dtype, np.inexact))
