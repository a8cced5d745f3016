"""The seams of a stage piece that runs its repeated blocks' plans.

The stage search prices a stage as the sum of its blocks' ILPs (``LayerCostCache.layer_cost``).
Where one block makes a value in one layout and the next reads it in another, running those
plans reshards the value at the seam: forward from the maker's layout to the reader's, and its
cotangent back the other way (the runtime pins each forward value to its maker's layout, and a
sharding constraint's transpose pins the cotangent alike). Those reshards are the price of
running the blocks' plans instead of solving the stage's piece as one ILP.

That one ILP's optimum is at least the sum of its blocks' optima (each block alone lays out its
inputs freely, the seams' edges dropped; up to what a block's ILP pays to be fed its inputs,
left out of its time), so the blocks' plans with their seams priced
are within ``(seams + the blocks' own gaps) / total`` of it. Where that is under ``STAGE_GAP``,
the piece runs the blocks' plans and reports that gap; elsewhere it is solved whole. On
GPT-39B's stages on 64 V100s the pieces solved whole came within 0.3% of their blocks' sums,
and each whole ILP took 1-5 s (docs/pipeline.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.cost.resharding import reshard_cost
from autopar.compiler.graph.opgraph import TensorInfo
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_program import PipelineProgram
from autopar.plan import CollectiveEstimate, ShardingSpec

# The largest relative gap a stage may run its blocks' plans at (the seams' reshards and the
# blocks' own ILP gaps over the priced total), the bar the issue on planning at scale sets for
# a plan that is not proven optimal.
STAGE_GAP = 0.01


@dataclass(frozen=True)
class SeamCost:
    """Per microbatch: the seconds of the reshards at a piece's seams (forward and backward),
    their collectives, and how many seam values disagree."""

    time_s: float
    collectives: tuple[CollectiveEstimate, ...]
    disagreeing: int


def price_seams(pp: PipelineProgram, units: Sequence[Piece],
                reads: Sequence[dict[int, ShardingSpec]], made: dict[int, ShardingSpec],
                mesh: LogicalMesh) -> SeamCost | None:
    """The reshards between ``units`` (a piece's blocks in order) when each runs its own plan:
    ``reads[k]``, the layouts block ``k`` reads its inputs in; ``made``, the layouts the
    blocks make their forward values in. None where a value one block passes another has no
    layout it is made in (nothing to price it from)."""
    fwd = pp.forward
    time_s, disagreeing = 0.0, 0
    moves: list[CollectiveEstimate] = []
    inside: set[int] = set()
    for k, unit in enumerate(units):
        if k:
            for v, spec in reads[k].items():
                if v not in inside or made.get(v) == spec:
                    continue
                if v not in made:
                    return None
                aval = fwd.avals[v]
                tensor = TensorInfo(v, tuple(int(d) for d in aval.shape), str(aval.dtype),
                                    "intermediate")
                ways = [(made[v], spec)]
                if np.issubdtype(aval.dtype, np.floating):  # its cotangent comes back
                    ways.append((spec, made[v]))
                for src, dst in ways:
                    move = reshard_cost(src, dst, tensor, mesh)
                    time_s += move.time_s
                    moves.extend(move.collectives)
                disagreeing += 1
        inside.update(v for i in unit.eqns for v in fwd.eqns[i].outputs)
    return SeamCost(time_s, tuple(moves), disagreeing)


def stitched_gap(unit_objectives: Sequence[float], unit_gaps: Sequence[float | None],
                 seams_s: float) -> float:
    """The relative gap of the blocks' plans run together, their ``seams_s`` priced, over the
    sum of the blocks' optima (each block's objective less its own ILP gap): a bound on how
    far the plan is from the piece's own ILP's optimum."""
    upper = sum(unit_objectives) + seams_s
    lower = sum(obj * (1.0 - (gap or 0.0))
                for obj, gap in zip(unit_objectives, unit_gaps, strict=True))
    return max(0.0, upper - lower) / upper if upper > 0 else 0.0
