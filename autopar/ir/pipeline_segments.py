"""The pipeline's segments: the step's equations outside the loss (batch preprocessing before
it, the optimizer update after it), each placed on a home stage and grouped by (phase, level,
stage) into runs that each execute as one jitted function. The compiler prices and the runtime
runs the same grouping, made here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.ir.pieces import Piece
from autopar.ir.pipeline_pieces import input_consumers
from autopar.ir.pipeline_program import PipelineProgram


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

    after = pp.after_gradients
    eqn_home: dict[int, int] = {}
    skipped = pp.driver_eqns
    value_bytes = pp.outer_value_bytes
    for i in sorted(after - skipped):  # after the gradients: follow the operand bytes
        e = outer.eqns[i]
        weight: dict[int, float] = {}
        for v in e.inputs:
            if v in home:
                weight[home[v]] = weight.get(home[v], 0.0) + value_bytes[v] + 1.0
        if weight:
            # the most bytes; of equal weights, the first stage
            stage = next(iter(weight)) if len(weight) == 1 else \
                max(sorted(weight), key=weight.__getitem__)
            eqn_home[i] = stage
            for v in e.outputs:
                home[v] = stage
    readers = pp.outer_readers
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


def _group(pp: PipelineProgram, eqn_home: dict[int, int], after: frozenset[int]
           ) -> list[Segment]:
    outer = pp.outer
    made_by = pp.outer_producers
    eqns = outer.eqns
    level: dict[int, int] = {}
    skipped = pp.driver_eqns
    groups: dict[tuple[str, int, int], list[int]] = {}
    for e in eqns:  # in program order: every producer's level is known before its readers'
        i = e.index
        if i in skipped:
            continue
        late, home = i in after, eqn_home[i]
        lv = 0
        for v in e.inputs:
            src = made_by.get(v)
            if src is None or src in skipped or (src in after) != late:
                continue
            lv = max(lv, level[src] + (eqn_home[src] != home))
        level[i] = lv
        groups.setdefault(("after" if late else "before", lv, home), []).append(i)
    constant = pp.outer_constants
    group_of = {i: key for key, members in groups.items() for i in members}
    readers = pp.outer_readers
    needed_outside = set(outer.out_ids) | set(pp.vg.inputs)
    segments = []
    for key in sorted(groups, key=lambda k: (k[0] != "before", k[1], k[2])):
        members = groups[key]
        defined = {v for i in members for v in eqns[i].outputs}
        inputs = sorted({v for i in members for v in eqns[i].inputs} - defined - constant)
        # a value leaves its segment when the step returns it or another segment reads it
        outputs = sorted(
            v for v in defined
            if v in needed_outside or any(
                r not in skipped and group_of[r] != key for r in readers.get(v, ()))
        )
        segments.append(
            Segment(key[0], key[1], key[2], tuple(members), tuple(inputs), tuple(outputs))
        )
    return segments
