"""One pipelined plan the stage search compares (``PipelineCandidate``) and its whole-step
estimate (``estimate_candidate``: ``inter_op/pipeline_cost`` with the driver counted on its
real pieces); apart so that the search (``pipeline_search``) and the hand splits beside it
(``pipeline_splits``) both make them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.pipeline_cost import (
    PipelineEstimate,
    driver_counts,
    estimate_pipeline,
    one_program_call_s,
)
from autopar.compiler.inter_op.stages import (
    StagePartition,
)
from autopar.compiler.inter_op.step_parts import step_work
from autopar.compiler.planners.stage_costs import (
    range_pieces,
    submesh_mesh,
)
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.pipeline_segments import Segment, plan_segments
from autopar.plan import MethodName


def forward_graph(pp: PipelineProgram, cache: LayerCostCache) -> OpGraph:
    """``pp``'s forward as a graph, made once per cache (each schedule's search and its deep
    splits read it: at GPT-3 175B each build took 0.6 s)."""
    graph: OpGraph = cache.shared(pp, ("forward graph",), lambda: build_graph(pp.forward))
    return graph


@dataclass
class PipelineCandidate:
    """One pipelined plan the search compared: its stages, on how many replicas of how many
    hosts, with how many microbatches per replica, and its whole-step estimate."""

    name: str
    partition: StagePartition
    positions: tuple[int, ...]
    replicas: int
    num_microbatches: int
    cluster: ClusterSpec
    estimate: PipelineEstimate
    chunks: int = 1
    note: str = ""

    def summary(self) -> dict[str, Any]:
        """The candidate as the plan's planning record lists it."""
        return {
            "name": self.name,
            "method": MethodName.PIPESHARD.value,
            "est_step_time_s": self.estimate.total_s,
            "fits": True,
            "num_stages": len(self.partition.stages),
            "replicas": self.replicas,
            "num_microbatches": self.num_microbatches,
            "stages": [f"{st.start}-{st.end - 1}@{st.submesh}" for st in self.partition.stages],
            "estimate": self.estimate.to_dict(),
            "note": self.note,
        }


def estimate_candidate(pp: PipelineProgram, partition: StagePartition,
                       positions: Sequence[int], schedule: str, m: int, chunks: int,
                       cluster: ClusterSpec, cache: LayerCostCache) -> PipelineEstimate:
    """The whole-step estimate of ``partition`` (``pipeline_cost.estimate_pipeline``): the
    driver counted on its real pieces, the preprocessing on the first stage's devices. The
    pieces and the step's segments depend on the stages' layers only, which the schedules'
    searches often share (the equal splits; a replica count's DP): made once per cache."""
    owner, ranges = piece_owners(len(partition.stages), chunks, partition, positions)

    def pieces_and_segments() -> tuple[list[Piece], list[Segment]]:
        pieces = range_pieces(pp, positions, ranges)
        return pieces, plan_segments(pp, pieces, owner)[0]

    pieces, segments = cache.shared(
        pp, ("pieces and segments", tuple(positions), tuple(ranges), tuple(owner)),
        pieces_and_segments)
    counts = driver_counts(pp, pieces, owner, schedule, m, chunks, segments=segments)
    first = partition.stages[0]
    mesh = submesh_mesh(cluster, first.submesh, first.candidate.logical_mesh_shape)
    work = cache.work or step_work(pp)
    before = work.before_seconds(mesh, first.submesh.num_devices)
    accumulate = m * sum(st.candidate.param_bytes for st in partition.stages) \
        / cluster.runtime.accumulate_bytes_per_s
    return estimate_pipeline(
        schedule, m, [st.candidate.time for st in partition.stages],
        [st.candidate.tail_time for st in partition.stages], num_chunks=chunks,
        before_s=before, host_s=counts.seconds(cluster.runtime, one_program_call_s(pp, cluster)),
        counts=counts,
        accumulate_s=accumulate)


def piece_owners(p: int, chunks: int, partition: StagePartition,
                 positions: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The stage owning each piece, and each piece's layer range (``chunks`` > 1: the
    interleaved schedule's ``p * chunks`` equal pieces)."""
    num_layers = len(positions) + 1
    if chunks == 1:
        return list(range(p)), [(st.start, st.end) for st in partition.stages]
    # p * v equal pieces; piece k runs on stage k mod p (Megatron's mapping)
    size = num_layers // (p * chunks)
    return ([k % p for k in range(p * chunks)],
            [(k * size, (k + 1) * size) for k in range(p * chunks)])

