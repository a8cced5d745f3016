"""Pieces of a loss forward: contiguous runs of its equations cut at positions, with the values
each reads from before it and gives to after it. The pipeline's stages, the rematerialised
layers and the layer-by-layer gradient (``layered_grad``) all cut the forward with these, so a
piece means the same equations to each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.errors import PlanError
from autopar.ir.program import FlatProgram, TensorKind


@dataclass(frozen=True)
class Piece:
    """A contiguous run of forward equations; ``inputs`` are read here and defined elsewhere
    (forward inputs or earlier pieces), ``outputs`` are defined here and read later (or are
    the forward's results)."""

    index: int
    eqns: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


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
    made_by: list[list[int]] = [[] for _ in spans]  # each piece's values (one pass: GPT 1T's
    for v, p in piece_of.items():                   # 64 pieces each read every value before)
        made_by[p].append(v)
    pieces = []
    for k, (a, b) in enumerate(spans):
        inputs = sorted(v for v in reads[k] if piece_of.get(v, -1) != k)
        outputs = sorted(v for v in made_by[k] if read_later.get(v, -1) > k or v in results)
        pieces.append(Piece(k, tuple(range(a, b)), tuple(inputs), tuple(outputs)))
    return pieces


class PieceSlicer:
    """Pieces of one forward for any span of equations, each made in time proportional to
    its own equations (``cut_pieces`` reads the whole forward): where each value is defined
    and last read is indexed once. ``piece(a, b)`` equals the piece ``[a, b)`` of any
    ``cut_pieces`` that cuts at ``a`` and ``b``."""

    def __init__(self, forward: FlatProgram) -> None:
        self.forward = forward
        self._constant = {v for v, kind in forward.kinds.items()
                          if kind in (TensorKind.CONST, TensorKind.LITERAL)}
        self._defined_at: dict[int, int] = {}
        self._last_read: dict[int, int] = {}
        for i, e in enumerate(forward.eqns):
            for v in e.outputs:
                self._defined_at[v] = i
            for v in e.inputs:
                self._last_read[v] = i
        for v in forward.out_ids:  # a result is read after every equation
            self._last_read[v] = len(forward.eqns)

    def piece(self, a: int, b: int, index: int = 0) -> Piece:
        """Equations ``[a, b)`` as a piece numbered ``index``."""
        eqns = self.forward.eqns[a:b]
        defined = self._defined_at
        reads = {v for e in eqns for v in e.inputs if v not in self._constant}
        inputs = sorted(v for v in reads if not a <= defined.get(v, -1) < b)
        outputs = sorted(v for e in eqns for v in e.outputs
                         if self._last_read.get(v, -1) >= b)
        return Piece(index, tuple(range(a, b)), tuple(inputs), tuple(outputs))


class LayerRanges:
    """Pieces for runs of consecutive layers, joined from the layers' own inputs and outputs
    (``layers``: a ``cut_pieces`` of ``forward``) without a pass over the equations: the
    stage search asks for every range of layers, over forwards of ten thousand equations.
    ``piece(start, end)`` equals ``cut_pieces``' piece for the run of layers
    ``[start, end)``."""

    def __init__(self, forward: FlatProgram, layers: Sequence[Piece]) -> None:
        self.layers = list(layers)
        # the last layer reading each value (past the last layer: a result of the forward)
        self._last_reader: dict[int, int] = {}
        for k, layer in enumerate(self.layers):
            for v in layer.inputs:
                self._last_reader[v] = k
        for v in forward.out_ids:
            self._last_reader[v] = len(self.layers)

    def piece(self, start: int, end: int) -> Piece:
        """Layers ``[start, end)`` as one piece."""
        run = self.layers[start:end]
        made = set().union(*(layer.outputs for layer in run))
        read = set().union(*(layer.inputs for layer in run))
        first, last = run[0].eqns[0], run[-1].eqns[-1] + 1
        outputs = sorted(v for v in made if self._last_reader.get(v, -1) >= end)
        return Piece(0 if first == 0 else 1, tuple(range(first, last)), tuple(sorted(read - made)),
                     tuple(outputs))
