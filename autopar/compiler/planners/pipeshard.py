"""PipeshardParallel planning: layers, the stage DP over per-layer ILP costs, stage plans.

The loss forward is cut into layers (the user's marks or Alpa's clustering). Every layer is
costed by the intra-operator ILP on every submesh shape and logical mesh shape (structurally
identical layers once: ``LayerCostCache``); a stage's cost is the sum of its layers' (Alpa
solves each candidate stage whole; summing layers keeps a 48-layer, 64-device search to a few
dozen small ILPs). The stage DP picks layer ranges and submeshes; each chosen stage's pieces
are then solved whole on their logical mesh, and that plan's input shardings are what the
runtime places.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.remat import is_remat_key, remat_candidates
from autopar.compiler.inter_op.stages import (
    StageCandidate,
    StageCostTable,
    StageDPOptions,
    StagePartition,
    SubmeshShape,
    manual_stages,
    place_submeshes,
    solve_stages,
    submesh_shapes,
    uniform_stages,
)
from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
from autopar.errors import InvalidOptionError, PlanError
from autopar.ir.pipeline_program import Piece, PipelineProgram, cut_pieces
from autopar.ir.schedule_timeline import stage_timeline
from autopar.ir.schedules import ScheduleName
from autopar.methods import ManualStages, PipeshardParallel
from autopar.plan import (
    InputSignature,
    MethodName,
    PipelineLayout,
    Plan,
    PlanningRecord,
    StagePlan,
)


def _span(positions: Sequence[int], n: int, start: int, end: int) -> tuple[int, int]:
    cuts = [0, *positions, n]
    return cuts[start], cuts[end]


def range_piece(pp: PipelineProgram, positions: Sequence[int], start: int, end: int) -> Piece:
    """Layers ``[start, end)`` as one piece."""
    n = len(pp.forward.eqns)
    a, b = _span(positions, n, start, end)
    pieces = cut_pieces(pp.forward, [p for p in (a, b) if 0 < p < n])
    return next(p for p in pieces if p.eqns and p.eqns[0] == a)


def logical_shapes(submesh: SubmeshShape) -> list[tuple[int, ...]]:
    """Logical meshes tried on a submesh: one axis over all its devices, and a 2-D one: hosts x
    devices per host across hosts (the slow links on one axis), 2 x n/2 inside a host."""
    n = submesh.num_devices
    shapes: list[tuple[int, ...]] = [(n,)]
    if submesh.num_hosts > 1:
        shapes.append((submesh.num_hosts, submesh.devices_per_host))
    elif n >= 4:
        shapes.append((2, n // 2))
    return shapes


def _submesh_mesh(cluster: ClusterSpec, submesh: SubmeshShape, shape: tuple[int, ...],
                  device_ids: Sequence[int] | None = None) -> LogicalMesh:
    ids = device_ids if device_ids is not None else range(submesh.num_devices)
    return LogicalMesh.from_cluster(cluster, shape, device_ids=tuple(ids))


@dataclass
class CostClock:
    """Seconds spent costing layers (tracing their train graphs and solving their ILPs) while
    the stage DP reads the table: the table is filled lazily, so the DP's own time is the
    search's total minus this."""

    seconds: float = 0.0


def stage_cost_table(pp: PipelineProgram, positions: Sequence[int], method: PipeshardParallel,
                     cluster: ClusterSpec, cache: LayerCostCache,
                     clock: CostClock | None = None) -> StageCostTable:
    """Candidates for every layer range and submesh: per logical mesh shape, the sum of the
    layers' ILP costs (filled lazily: the DP reads every entry, baselines only a few).
    ``clock``: accumulates the seconds spent in the layers' cost lookups and solves."""
    layers = cut_pieces(pp.forward, positions)

    def candidates(start: int, end: int, submesh: SubmeshShape) -> list[StageCandidate]:
        found = []
        start_s = time.perf_counter()
        for shape in logical_shapes(submesh):
            mesh = _submesh_mesh(cluster, submesh, shape)
            costs = [cache.cost(pp, layers[k], mesh) for k in range(start, end)]
            found.extend(remat_candidates(costs, shape, method.remat))
        if clock is not None:
            clock.seconds += time.perf_counter() - start_s
        return found

    submeshes = submesh_shapes(cluster.num_hosts, cluster.devices_per_host)
    return StageCostTable(len(positions) + 1, submeshes, candidates)


def _dp_options(method: PipeshardParallel, cluster: ClusterSpec) -> StageDPOptions:
    """The stage search's options: the method's real schedule and chunks, so that every stage
    is sized with the microbatches that schedule holds on it (``activation_counts``)."""
    budget = method.memory_budget_bytes or cluster.device.memory_bytes
    interleaved = method.schedule == ScheduleName.INTERLEAVED_1F1B
    if interleaved and method.num_chunks < 2:
        raise InvalidOptionError(
            f"interleaved-1f1b needs num_chunks >= 2, got {method.num_chunks}")
    return StageDPOptions(num_microbatches=method.num_microbatches, schedule=method.schedule,
                          memory_budget_bytes=budget, num_stages=method.num_stages,
                          num_chunks=method.num_chunks if interleaved else 1)


# Stage costs feed a DP whose inputs are estimates anyway: 0.1% of a layer's time is far below
# the cost model's own error, and proving the last 0.1% is most of HiGHS's time on big layers.
STAGE_COST_RELATIVE_GAP = 1e-3
# The stage search solves one ILP per distinct layer and mesh; on multi-host 2-D meshes HiGHS
# can take 10+ s to prove what its first seconds found. Each gets at most this long (the best
# plan so far is used when it runs out), the chosen stages' own solves included.
STAGE_COST_TIME_LIMIT_S = 1.0


def _intra_options(method: PipeshardParallel) -> IntraOpOptions:
    return IntraOpOptions(solver=method.solver,
                          time_limit_s=min(method.time_limit_s, STAGE_COST_TIME_LIMIT_S),
                          batch_argnums=(1,), relative_gap=STAGE_COST_RELATIVE_GAP)


def layer_cost_cache(method: PipeshardParallel) -> LayerCostCache:
    """An empty cache of layer costs with the ILP options ``method`` plans with: pass the same
    one to ``plan_pipeshard`` and ``stage_baselines`` to solve each layer and mesh once."""
    return LayerCostCache(_intra_options(method))


def stage_baselines(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec, *,
                    cache: LayerCostCache | None = None,
                    num_stages: int | None = None) -> dict[str, StagePartition]:
    """The DP's stages beside the two usual hand splits with as many stages: equal layers on
    equal submeshes, and equal numbers of operators on equal submeshes.

    ``cache``: layer costs already solved (``layer_cost_cache``). ``num_stages``: the hand
    splits' stage count instead of the DP's (PlanError when it does not split the layers and
    devices evenly)."""
    graph = build_graph(pp.forward)
    cache = cache if cache is not None else layer_cost_cache(method)
    options = _dp_options(method, cluster)
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    positions = layer_positions(pp, graph, method.layers, cluster.num_devices)
    table = stage_cost_table(pp, positions, method, cluster, cache)
    best = solve_stages(table, hosts, per_host, options)
    p = num_stages if num_stages is not None else len(best.stages)
    found = {"dp": best}
    if p > 1:
        found["equal-layer"] = uniform_stages(table, p, hosts, per_host, options)
        n = len(pp.forward.eqns)
        by_count = [round(k * n / p) for k in range(1, p)]
        ops_table = stage_cost_table(pp, by_count, method, cluster, cache)
        found["equal-operator"] = uniform_stages(ops_table, p, hosts, per_host, options)
    return found


def plan_pipeshard(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                   cluster_name: str | None = None, *,
                   cache: LayerCostCache | None = None) -> Plan:
    """Plan ``pp`` (built with ``method.num_microbatches``) on ``cluster``.

    ``cache``: layer costs to reuse and fill (``layer_cost_cache``; default: a fresh one).
    ``plan.planning.phases`` splits the planning seconds: ``layers_s`` (clustering),
    ``stage_costs_s`` (the per-layer ILPs the DP asked for), ``stage_dp_s`` (the DP without
    them), ``stage_plans_s`` (the chosen stages solved whole) and ``total_s``."""
    start = time.perf_counter()
    m = method.num_microbatches
    graph = build_graph(pp.forward)
    positions = layer_positions(pp, graph, method.layers, cluster.num_devices)
    num_layers = len(positions) + 1
    cache = cache if cache is not None else layer_cost_cache(method)
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    clock = CostClock()
    table = stage_cost_table(pp, positions, method, cluster, cache, clock)
    dp_options = _dp_options(method, cluster)
    searched = time.perf_counter()
    partition, chunks = _partition(method, table, num_layers, hosts, per_host, dp_options)
    solved = time.perf_counter()
    placed = place_submeshes(list(partition.submeshes), hosts, per_host)
    layout, piece_ranges = _layout(method, partition, positions, chunks)
    pieces = [range_piece(pp, positions, a, b) for a, b in piece_ranges]
    stages = []
    for s, assignment in enumerate(partition.stages):
        shape = assignment.candidate.logical_mesh_shape
        mesh = _submesh_mesh(cluster, assignment.submesh, shape, placed[s])
        specs, compute = {}, 0.0
        for k, piece in enumerate(pieces):
            if layout.stage_of_piece[k] == s:
                cost = cache.cost(pp, piece, mesh)
                specs.update(cost.input_specs)
                compute += cost.compute_s
        c = assignment.candidate
        compute = min(compute, c.time)
        stages.append(StagePlan(
            index=s,
            layers=tuple(range(assignment.start, assignment.end)),
            submesh_shape=(assignment.submesh.num_hosts, assignment.submesh.devices_per_host),
            logical_mesh_shape=tuple(shape),
            axis_names=tuple(mesh.axis_names),
            device_ids=tuple(mesh.device_ids),
            input_shardings=_input_paths(pp, specs),
            tensor_shardings=specs,
            est_time_s=c.time,
            est_compute_time_s=compute,
            est_communication_time_s=c.time - compute,
            peak_memory_bytes=int(c.memory(dp_options.in_flight(s, len(partition.stages)))),
            memory_breakdown={"fixed": int(c.fixed_memory),
                              "activations_per_microbatch":
                                  int(c.activation_memory_per_microbatch)},
        ))
    timeline = stage_timeline(method.schedule, [st.est_time_s for st in stages], m, chunks)
    end = time.perf_counter()
    timings = {
        "layers_s": searched - start,
        "stage_costs_s": clock.seconds,
        "stage_dp_s": solved - searched - clock.seconds,
        "stage_plans_s": end - solved,
        "total_s": end - start,
    }
    notes = []
    if not partition.exact:
        notes.append("stage search thinned its stage-time caps: not proven optimal")
    if method.schedule == ScheduleName.INTERLEAVED_1F1B and method.stages == "auto":
        notes.append("interleaved-1f1b uses uniform stages (equal layers on equal submeshes)")
    return Plan(
        method=MethodName.PIPESHARD,
        mesh_shape=(len(stages),),
        cluster=cluster_name or cluster.name,
        stages=stages,
        est_step_time_s=timeline.makespan,
        total_flops=3.0 * graph.total_flops * m,
        num_microbatches=m,
        signature=[
            InputSignature(path, tuple(int(d) for d in pp.outer.avals[v].shape),
                           str(pp.outer.avals[v].dtype))
            for v, path in zip(pp.outer.in_ids, pp.outer.in_paths, strict=True)
        ],
        pipeline=layout,
        planning=PlanningRecord(
            planning_time_s=timings["total_s"],
            phases=timings,
            stage_search=partition.to_dict() | {"ilp_solves": cache.ilp_solves},
            estimated_idle_fraction=timeline.idle_fraction,
            theoretical_idle_fraction=timeline.theoretical_idle_fraction,
        ),
        notes=notes,
    )


def _input_paths(pp: PipelineProgram, specs: dict) -> dict:
    """The specs of loss inputs that are step inputs (parameters, batch leaves), by path."""
    outer = pp.outer
    path_of = dict(zip(outer.in_ids, outer.in_paths, strict=True))
    found = {}
    for fid, spec in specs.items():
        path = path_of.get(pp.operand_of.get(fid, -1))
        if path is not None:
            found[path] = spec
    return found


def _partition(method: PipeshardParallel, table: StageCostTable, num_layers: int, hosts: int,
               per_host: int, options: StageDPOptions) -> tuple[StagePartition, int]:
    if isinstance(method.stages, ManualStages):
        shapes = [SubmeshShape(h, d) for h, d in method.stages.submesh_shapes]
        ranges = [tuple(r) for r in method.stages.layer_ranges]
        return manual_stages(table, ranges, shapes, hosts, per_host, options), 1
    if options.schedule == ScheduleName.INTERLEAVED_1F1B or method.stages == "uniform":
        p = method.num_stages or 2
        v = options.num_chunks
        if num_layers % (p * v):
            raise PlanError(f"{num_layers} layers cannot be cut into {p} stages x {v} chunks "
                            "of equal layers; choose layers as a multiple of stages x chunks")
        return uniform_stages(table, p, hosts, per_host, options), v
    return solve_stages(table, hosts, per_host, options), 1


def _layout(method: PipeshardParallel, partition: StagePartition, positions: Sequence[int],
            chunks: int) -> tuple[PipelineLayout, list[tuple[int, int]]]:
    p = len(partition.stages)
    num_layers = len(positions) + 1
    if chunks == 1:
        ranges = [(st.start, st.end) for st in partition.stages]
        owner = list(range(p))
    else:  # p * v equal pieces; piece k runs on stage k mod p (Megatron's mapping)
        size = num_layers // (p * chunks)
        ranges = [(k * size, (k + 1) * size) for k in range(p * chunks)]
        owner = [k % p for k in range(p * chunks)]
    cuts = [positions[a - 1] for a, _ in ranges[1:]]
    remat = tuple(is_remat_key(st.candidate.key) for st in partition.stages)
    layout = PipelineLayout(method.schedule, chunks, tuple(positions), tuple(cuts), tuple(owner),
                            remat)
    return layout, ranges
