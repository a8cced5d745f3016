"""Where the loss forward repeats one block of equations (a transformer's layers), so that a
stage's cost can be solved per block: one sharding ILP for the block, not one per run of
blocks.

The stage search cuts the forward into at most ``DEFAULT_MAX_LAYERS`` layers (the DP's
granularity); at published sizes each holds several transformer blocks (GPT-3 175B: six), and
the layer's ILP grows with them. A stage's cost is already the sum of its layers' costs
(``stage_costs``: layouts chosen per layer, the resharding between them unpriced, as between
any two layers); cutting each layer further at block boundaries keeps that sum and makes the
blocks identical pieces, which ``LayerCostCache`` solves once per logical mesh. Measured on
GPT-39B, the sum of a 3-block layer's blocks is within 0.7% of the layer's own ILP on every
mesh tried (most within 1e-5), at a fifth of the solve time.

A block is found from the equations alone: the period ``p`` whose run of equal equations
(``eqns[i]`` and ``eqns[i + p]`` alike in primitive, parameters and shapes) covers the most
of the forward, the smallest such. Its cuts are put where the layers' own cuts fall in the
period (the clustering chose them for small transfers), else where the run starts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.ir.program import FlatProgram

# A block shorter than this is not worth a piece of its own (a run of elementwise ops).
MIN_BLOCK_EQNS = 8


@dataclass(frozen=True)
class RepeatGrid:
    """Blocks of ``period`` equations from ``start`` to ``end`` (``end - start`` a multiple
    of ``period``, at least two blocks): the forward's repeated structure."""

    period: int
    start: int
    end: int

    @property
    def num_blocks(self) -> int:
        return (self.end - self.start) // self.period

    def whole_blocks(self, num_eqns: int) -> int:
        """How many blocks a forward of ``num_eqns`` equations holds: the grid's, and one
        more where the equations outside it (before and after) make a block's length: the
        grid's phase, set by the layer cuts, can leave one block in two parts at its ends
        (GPT 529.6B's 105 layers are a grid of 104 and two parts)."""
        outside = self.start + num_eqns - self.end
        return self.num_blocks + (1 if outside >= self.period else 0)

    def cuts_within(self, a: int, b: int) -> list[int]:
        """The block boundaries strictly inside equations ``[a, b)``."""
        first = self.start + max(0, -(-(a + 1 - self.start) // self.period)) * self.period
        return list(range(first, min(b, self.end + 1), self.period))


def _equation_classes(forward: FlatProgram) -> np.ndarray:
    """One integer per equation, equal for equations alike in primitive, parameters and the
    shapes and dtypes of their operands and results."""
    ids: dict[tuple, int] = {}
    out = np.empty(len(forward.eqns), np.int64)
    for i, e in enumerate(forward.eqns):
        key = (e.name, tuple(sorted((k, repr(v)) for k, v in e.params.items())),
               tuple(str(forward.avals[v]) for v in e.inputs),
               tuple(str(forward.avals[v]) for v in e.outputs))
        out[i] = ids.setdefault(key, len(ids))
    return out


def _longest_run(same: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True in ``same`` ((0, 0) when none)."""
    padded = np.concatenate(([False], same, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    if not len(edges):
        return 0, 0
    starts, ends = edges[::2], edges[1::2]
    k = int(np.argmax(ends - starts))
    return int(starts[k]), int(ends[k] - starts[k])


def find_repeats(forward: FlatProgram, positions: Sequence[int] = ()) -> RepeatGrid | None:
    """The forward's repeated block (None when no block of at least ``MIN_BLOCK_EQNS``
    equations repeats twice). ``positions``: the layers' cuts, whose place in the period the
    block boundaries take."""
    classes = _equation_classes(forward)
    n = len(classes)
    best: tuple[int, int, int] | None = None  # (covered, period, run start)
    for p in range(MIN_BLOCK_EQNS, n // 2 + 1):
        if best is not None and 2 * p > best[0]:
            break  # a longer period cannot cover more than its own two blocks
        start, length = _longest_run(classes[:-p] == classes[p:])
        if length >= p and (best is None or length + p > best[0]):
            best = (length + p, p, start)
    if best is None:
        return None
    covered, p, run_start = best
    run_end = run_start + covered
    phases = Counter((c - run_start) % p for c in positions if run_start <= c <= run_end)
    phase = phases.most_common(1)[0][0] if phases else 0
    start = run_start + phase
    blocks = (run_end - start) // p
    if blocks < 2:
        return None
    return RepeatGrid(p, start, start + blocks * p)
