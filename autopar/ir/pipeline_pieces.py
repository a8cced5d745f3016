"""The pipeline's pieces (``pieces``: the loss forward cut at equation positions into
contiguous runs, the virtual stages) and the role each piece input and output plays for its
forward and backward tasks. Planning and running both read pieces through these functions, so
a piece means the same equations, and its values the same roles, to the compiler's costs and
the runtime's tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from autopar.ir.pieces import Piece
from autopar.ir.pipeline_program import PipelineProgram


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


def least_cut_transfers(pp: PipelineProgram) -> int:
    """The fewest values a cut anywhere in the forward makes the driver place per microbatch,
    as ``piece_roles`` sorts them: each value defined before the cut and read after it is an
    input of a later piece and, where it is a float, also an output whose cotangent is placed
    and an activation whose gradient is sent back (three for a float, one otherwise). The
    least over every cut point: what a pipeline's first cut adds, wherever it is."""
    eqns = pp.forward.eqns
    defined = {v: i for i, eqn in enumerate(eqns) for v in eqn.outputs}
    last_read: dict[int, int] = {}
    for j, eqn in enumerate(eqns):
        for v in eqn.inputs:
            if v in defined:
                last_read[v] = j
    # a value defined by equation i and last read by j crosses the cuts before i + 1 .. j
    change = [0] * (len(eqns) + 1)
    for v, j in last_read.items():
        i = defined[v]
        if j > i:
            weight = 3 if _is_float(pp.forward.avals[v]) else 1
            change[i + 1] += weight
            change[j + 1] -= weight
    crossing, running = [], 0
    for c in range(1, len(eqns)):
        running += change[c]
        crossing.append(running)
    return min(crossing, default=0)


def _is_float(aval: Any) -> bool:
    # jax's issubdtype: a PRNG key's dtype (``key<fry>``) is no numpy dtype, and no float
    return bool(jax.dtypes.issubdtype(aval.dtype, np.inexact))
