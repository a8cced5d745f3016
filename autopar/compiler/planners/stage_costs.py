"""What a pipeline stage costs, the parts every table reads: the layer ranges' pieces, the
logical meshes a stage is costed on, the stage DP's options, the layer-cost cache's ILP options
and a stage's predicted collectives. The table itself (per layer range, submesh and logical
mesh, the layers' ILP costs summed with what the runtime adds) is ``stage_table``'s;
``planners/pipeshard`` runs the search on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.piece_cost import PieceCost
from autopar.compiler.inter_op.stages import (
    StageDPOptions,
    SubmeshShape,
)
from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
from autopar.errors import InvalidOptionError, MeshError
from autopar.ir.pieces import LayerRanges, Piece, cut_pieces
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.schedules import ScheduleName
from autopar.methods import PipeshardParallel, StageMode
from autopar.plan import CollectiveEstimate


def range_piece(pp: PipelineProgram, positions: Sequence[int], start: int, end: int) -> Piece:
    """Layers ``[start, end)`` as one piece."""
    return range_pieces(pp, positions, [(start, end)])[0]


def range_pieces(pp: PipelineProgram, positions: Sequence[int],
                 ranges: Sequence[tuple[int, int]]) -> list[Piece]:
    """The pieces of consecutive layer ranges ``ranges`` (``[start, end)`` each, in order),
    numbered as they come: the layers cut once (a piece per range cut the whole forward each
    time: 8 s of GPT 1T's search)."""
    layers = LayerRanges(pp.forward, cut_pieces(pp.forward, positions))
    return [replace(layers.piece(a, b), index=k) for k, (a, b) in enumerate(ranges)]


def logical_shapes(submesh: SubmeshShape) -> list[tuple[int, ...]]:
    """Logical meshes tried on a submesh: on one host, one axis over all its devices; then
    the 2-D ones ``(n / t, t)`` whose second axis (the one the ILP can give the model, as a
    data x tensor expert plan does) stays inside a host: ``t`` from 2 up to the devices per
    host, largest first, each a divisor of the submesh. A tensor degree beyond one host
    cannot win: its collectives would cross the slow links that the first axis's data
    parallelism crosses once per step. Nor can one axis over several hosts: every collective
    on it is priced at the links between hosts, while ``(hosts, devices per host)`` can lay
    out all it can (a dimension may be split over both axes) with the fast links inside a
    host (measured on GPT layers at 15B: 8-14x slower per microbatch)."""
    n = submesh.num_devices
    shapes: list[tuple[int, ...]] = [(n,)] if submesh.num_hosts == 1 else []
    t = min(submesh.devices_per_host, n // 2)
    while t >= 2:
        if n % t == 0 and submesh.devices_per_host % t == 0:
            shapes.append((n // t, t))
        t //= 2
    return shapes or [(n,)]


def stage_meshes(method: PipeshardParallel, submesh: SubmeshShape) -> list[tuple[int, ...]]:
    """The logical meshes a stage on ``submesh`` is costed on: the method's
    ``stage_mesh_shape`` where it covers the submesh (none elsewhere: no stage of that size),
    else ``logical_shapes``."""
    pinned = method.stage_mesh_shape
    if pinned is None:
        return logical_shapes(submesh)
    return [pinned] if math.prod(pinned) == submesh.num_devices else []


def check_stage_mesh(method: PipeshardParallel, cluster: ClusterSpec) -> None:
    """A pinned stage mesh must fill the cluster with the uniform stages' count (MeshError,
    one line, otherwise)."""
    shape = method.stage_mesh_shape
    if shape is None or method.stages != StageMode.UNIFORM:
        return
    stages = method.num_stages or 2
    need = math.prod(shape) * stages
    if need != cluster.num_devices:
        mesh = "x".join(map(str, shape))
        raise MeshError(f"{stages} stage(s) of a {mesh} mesh need {need} devices but the "
                        f"cluster has {cluster.num_devices}; choose degrees whose product is "
                        f"{cluster.num_devices}")


def submesh_mesh(cluster: ClusterSpec, submesh: SubmeshShape, shape: tuple[int, ...],
                 device_ids: Sequence[int] | None = None) -> LogicalMesh:
    """The logical mesh ``shape`` over a submesh of ``cluster`` (its first devices, or
    ``device_ids``)."""
    ids = device_ids if device_ids is not None else range(submesh.num_devices)
    return LogicalMesh.from_cluster(cluster, shape, device_ids=tuple(ids))


def stage_dp_options(method: PipeshardParallel, cluster: ClusterSpec,
                     num_microbatches: int | None = None) -> StageDPOptions:
    """The stage search's options: the method's real schedule and chunks, so that every stage
    is sized with the microbatches that schedule holds on it (``activation_counts``)."""
    budget = method.memory_budget_bytes or cluster.device.memory_bytes
    interleaved = method.schedule == ScheduleName.INTERLEAVED_1F1B
    if interleaved and method.num_chunks < 2:
        raise InvalidOptionError(
            f"interleaved-1f1b needs num_chunks >= 2, got {method.num_chunks}")
    return StageDPOptions(num_microbatches=num_microbatches or method.num_microbatches,
                          schedule=method.schedule, memory_budget_bytes=budget,
                          num_stages=method.num_stages,
                          num_chunks=method.num_chunks if interleaved else 1)


# Stage costs feed a DP whose inputs are estimates anyway: 0.1% of a layer's time is far below
# the cost model's own error, and proving the last 0.1% is most of HiGHS's time on big layers.
STAGE_COST_RELATIVE_GAP = 1e-3
# The stage search solves one ILP per distinct layer and mesh. Large ones are bounded by dual
# ascent first (intra_op/dual_bound), which proves most of them within the gap in about a
# second; the limit is there so that none is decided by it (at 1 s, 30 of the Alpa 15B row's
# ILPs stopped on it under load), the chosen stages' own solves included. At 10 s, two of
# Megatron 76.1B's block ILPs on its largest meshes (6-10 s each alone) stopped on it once
# both processes took those meshes at the same time: the method's own 30 s is the limit.
STAGE_COST_TIME_LIMIT_S = 30.0


def _intra_options(method: PipeshardParallel) -> IntraOpOptions:
    return IntraOpOptions(solver=method.solver,
                          time_limit_s=min(method.time_limit_s, STAGE_COST_TIME_LIMIT_S),
                          batch_argnums=(1,), relative_gap=STAGE_COST_RELATIVE_GAP)


def layer_cost_cache(method: PipeshardParallel) -> LayerCostCache:
    """An empty cache of layer costs with the ILP options ``method`` plans with: pass the same
    one to ``plan_pipeshard`` and ``stage_baselines`` to solve each layer and mesh once."""
    return LayerCostCache(_intra_options(method), num_microbatches=method.num_microbatches)


def stage_collectives(costs: Sequence[PieceCost], num_microbatches: int
                      ) -> list[CollectiveEstimate]:
    """What a stage's plan predicts it communicates in one step: each of its pieces' per
    microbatch collectives ``num_microbatches`` times and their per-step ones (the gradients'
    reduction) once, one estimate per (kind, mesh axes). Not counted: a rematerialised
    stage's recomputed forward, and the transfers between stages (no collectives)."""
    totals: dict[tuple, list[float]] = {}
    for cost in costs:
        for c, times in [(c, num_microbatches) for c in cost.collectives] + \
                [(c, 1) for c in cost.sync_collectives]:
            entry = totals.setdefault((c.kind.value, c.axes), [0, 0.0, 0.0])
            entry[0] += c.count * times
            entry[1] += c.nbytes * times
            entry[2] += c.time_s * times
    return [CollectiveEstimate(kind=kind, count=int(n), nbytes=b, axes=axes, time_s=t)
            for (kind, axes), (n, b, t) in sorted(totals.items())]
