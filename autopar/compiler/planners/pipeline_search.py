"""The pipelined candidates of a ``PipeshardParallel`` plan, compared before any stage is solved
whole: the stage DP over per-layer ILP costs on the whole cluster and, on several hosts, per
replica count (the pipeline replicated over groups of hosts), beside the equal-layer and
equal-operator splits, each judged by the whole step's estimate (``inter_op/pipeline_cost``).
``search_pipeshard`` returns them best first; ``pipeshard.finish_pipeshard`` turns the best into
the plan. Apart so that ``schedule="auto"`` searches every schedule and finishes only the one
it keeps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.pipeline_cost import (
    PipelineEstimate,
    driver_counts,
    estimate_pipeline,
)
from autopar.compiler.inter_op.stages import (
    StageCostTable,
    StageDPOptions,
    StagePartition,
    SubmeshShape,
    manual_stages,
    solve_stages,
    uniform_stages,
)
from autopar.compiler.inter_op.step_parts import step_work
from autopar.compiler.planners.stage_costs import (
    check_stage_mesh,
    layer_cost_cache,
    range_pieces,
    stage_dp_options,
    submesh_mesh,
)
from autopar.compiler.planners.stage_table import CostClock, stage_cost_table
from autopar.errors import PlanError
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.schedules import ScheduleName
from autopar.methods import (
    SCHEDULE_AUTO,
    ManualStages,
    PipeshardParallel,
    ReplicaMode,
    StageMode,
)
from autopar.plan import MethodName


def hand_split_counts(dp_stages: int, max_tries: int = 4) -> list[int]:
    """Stage counts for the equal-layer and equal-operator splits beside a DP that chose
    ``dp_stages``: that many (two when it chose one: a one-stage "split" is no pipeline), then
    the nearest counts (more stages first) for when it does not split the layers and devices
    evenly. The first that does is used (by the planner and the benchmark alike)."""
    wanted = max(2, dp_stages)
    counts = sorted(range(2, wanted + max_tries + 1), key=lambda c: (abs(c - wanted), -c))
    return counts[:max_tries]


def stage_baselines(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec, *,
                    cache: LayerCostCache | None = None,
                    num_stages: int | None = None) -> dict[str, StagePartition]:
    """The DP's stages beside the two usual hand splits with as many stages: equal layers on
    equal submeshes, and equal numbers of operators on equal submeshes (by the DP's own
    formula; :func:`hand_splits` gives their whole-step estimates).

    ``cache``: layer costs already solved (``layer_cost_cache``). ``num_stages``: the hand
    splits' stage count instead of the DP's (PlanError when it does not split the layers and
    devices evenly)."""
    graph = build_graph(pp.forward)
    cache = cache if cache is not None else layer_cost_cache(method)
    options = stage_dp_options(method, cluster)
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    positions = layer_positions(pp, graph, method.layers, cluster.num_devices)
    table = stage_cost_table(pp, positions, method, cluster, cache, prefetch_on=())
    best = solve_stages(table, hosts, per_host, options)
    p = num_stages if num_stages is not None else len(best.stages)
    found = {"dp": best}
    if p > 1:
        found["equal-layer"] = uniform_stages(table, p, hosts, per_host, options)
        ops = operator_positions(pp, p)
        ops_table = stage_cost_table(pp, ops, method, cluster, cache, prefetch_on=())
        found["equal-operator"] = uniform_stages(ops_table, p, hosts, per_host, options)
    return found


def operator_positions(pp: PipelineProgram, num_stages: int) -> list[int]:
    """Cuts of the loss forward into ``num_stages`` pieces of equal operator counts (inside
    blocks where they fall there: at GPT-39B the balance that buys is the best plan, 96.4
    against 98.2 s per step with the cuts moved to block boundaries)."""
    n = len(pp.forward.eqns)
    return [round(k * n / num_stages) for k in range(1, num_stages)]


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


def _estimate(pp: PipelineProgram, partition: StagePartition, positions: Sequence[int],
              schedule: str, m: int, chunks: int, cluster: ClusterSpec,
              cache: LayerCostCache) -> PipelineEstimate:
    """The whole-step estimate of ``partition`` (``pipeline_cost.estimate_pipeline``): the
    driver counted on its real pieces, the preprocessing on the first stage's devices."""
    owner, ranges = piece_owners(len(partition.stages), chunks, partition, positions)
    pieces = range_pieces(pp, positions, ranges)
    counts = driver_counts(pp, pieces, owner, schedule, m, chunks)
    first = partition.stages[0]
    mesh = submesh_mesh(cluster, first.submesh, first.candidate.logical_mesh_shape)
    work = cache.work or step_work(pp)
    before = work.before_seconds(mesh, first.submesh.num_devices)
    accumulate = m * sum(st.candidate.param_bytes for st in partition.stages) \
        / cluster.runtime.accumulate_bytes_per_s
    return estimate_pipeline(
        schedule, m, [st.candidate.time for st in partition.stages],
        [st.candidate.tail_time for st in partition.stages], num_chunks=chunks,
        before_s=before, host_s=counts.seconds(cluster.runtime), counts=counts,
        accumulate_s=accumulate)


def replica_counts(method: PipeshardParallel, cluster: ClusterSpec) -> list[int]:
    """How many data-parallel replicas of the pipeline the search tries: 1, and every count
    of equal groups of whole hosts that also divides the microbatches (each replica runs
    ``m / r`` of them), when the stages are the DP's own (not uniform, manual, interleaved)."""
    if method.replicas == ReplicaMode.NONE or method.stages != StageMode.AUTO \
            or method.schedule == ScheduleName.INTERLEAVED_1F1B:
        return [1]
    hosts, m = cluster.num_hosts, method.num_microbatches
    return [r for r in range(1, hosts + 1) if hosts % r == 0 and m % r == 0]


def driver_floor_s(method: PipeshardParallel, cluster: ClusterSpec) -> float:
    """The least host time the estimate gives any pipeline of two or more stages: each stage
    runs at least a forward and a backward task per microbatch (``driver_counts``), ``m / r``
    microbatches on each of ``r`` replicas' drivers, each task ``runtime.task_s``. A
    one-stage plan estimated below it leaves such pipelines nothing to win."""
    per_driver = method.num_microbatches // max(replica_counts(method, cluster))
    return 2 * 2 * per_driver * cluster.runtime.task_s


def search_pipelines(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                     positions: Sequence[int], cache: LayerCostCache,
                     clock: CostClock) -> list[PipelineCandidate]:
    """Every pipelined plan the search compares, best first: the stage DP's on the whole
    cluster and, per replica count, on each group of hosts; beside the DP's own, the
    equal-layer and equal-operator splits (the stage DP's formula is Alpa's, the candidates
    are judged by the whole-step estimate, so a hand split can win: then it is the plan)."""
    num_layers = len(positions) + 1
    found: list[PipelineCandidate] = []
    last_error: PlanError | None = None
    for r in replica_counts(method, cluster):
        group = cluster.with_hosts(cluster.num_hosts // r)
        m = method.num_microbatches // r
        hosts, per_host = group.num_hosts, group.devices_per_host
        options = stage_dp_options(method, group, m)
        table = stage_cost_table(pp, positions, method, group, cache, clock,
                                 num_microbatches=m, replicas=r, whole=cluster)
        try:
            partition, chunks = _partition(method, table, num_layers, hosts, per_host, options)
        except PlanError as err:
            if r == 1:
                raise
            last_error = err
            continue
        label = "stage DP" if method.stages == StageMode.AUTO else f"stages='{method.stages}'"
        if isinstance(method.stages, ManualStages):
            label = "manual stages"
        where = f" x {r} replicas of {hosts} host(s)" if r > 1 else ""
        found.append(PipelineCandidate(
            f"{label}{where}", partition, tuple(positions), r, m, group,
            _estimate(pp, partition, positions, method.schedule, m, chunks, group, cache),
            chunks))
        if r > 1 or method.stages != StageMode.AUTO or method.schedule == \
                ScheduleName.INTERLEAVED_1F1B:
            continue
        for split in hand_splits(pp, method, group, cache, positions, table,
                                 len(partition.stages), clock):
            found.append(split)
    if not found and last_error is not None:
        raise last_error
    if method.stages == StageMode.AUTO and method.schedule != ScheduleName.INTERLEAVED_1F1B:
        best = min((c.estimate.total_s for c in found), default=math.inf)
        found.extend(deep_equal_splits(pp, method, cluster, cache, num_layers, clock,
                                       beat=best))
    return sorted(found, key=lambda c: c.estimate.total_s)


def deep_stage_counts(blocks: int, num_layers: int, num_hosts: int,
                      num_devices: int) -> list[int]:
    """Stage counts beyond the stage DP's ``num_layers`` layers that split the forward's
    ``blocks`` repeated blocks and the devices (whole hosts per stage on several hosts) into
    equal parts."""
    units = num_hosts if num_hosts > 1 else num_devices
    return [p for p in range(num_layers + 1, blocks + 1)
            if blocks % p == 0 and units % p == 0]


def deep_equal_splits(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                      cache: LayerCostCache, num_layers: int,
                      clock: CostClock | None = None, *,
                      beat: float = math.inf) -> list[PipelineCandidate]:
    """Pipelines of more stages than the stage DP has layers, which it cannot build: for
    each count of :func:`deep_stage_counts`, the forward clustered into that many layers, one
    per stage, on equal submeshes (Megatron-LM's deep pipelines: GPT 529.6B's 105 layers in
    35 stages of 9 hosts), each with its whole-step estimate. The stage DP's layers stay few
    (``layers.DEFAULT_MAX_LAYERS``): its time grows with their square, these with their
    count. A split is estimated only where its bound is below ``beat`` (the best pipeline
    found so far): the step takes at least each stage's microbatches back to back and then
    its tail, and simulating a schedule of 105 stages and 280 microbatches takes seconds."""
    grid = cache.grid
    if grid is None or pp.layer_scans:
        return []
    blocks = grid.whole_blocks(len(pp.forward.eqns))
    counts = deep_stage_counts(blocks, num_layers, cluster.num_hosts, cluster.num_devices)
    if not counts:
        return []
    graph = build_graph(pp.forward)
    options = stage_dp_options(method, cluster)
    m = method.num_microbatches
    out = []
    for count in counts:
        try:
            positions = layer_positions(pp, graph, count, cluster.num_devices)
            table = stage_cost_table(pp, positions, method, cluster, cache, clock,
                                     prefetch_on=())
            split = uniform_stages(table, count, cluster.num_hosts, cluster.devices_per_host,
                                   options)
        except PlanError:  # no submesh of that size, or nothing fits
            continue
        if max(m * st.candidate.time + st.candidate.tail_time for st in split.stages) >= beat:
            continue
        estimate = _estimate(pp, split, positions, method.schedule, m, 1, cluster, cache)
        out.append(PipelineCandidate("equal-block", split, tuple(positions), 1, m, cluster,
                                     estimate, note=f"{count} stages of {blocks // count} "
                                     f"of the {blocks} repeated blocks"))
    return out


def hand_splits(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                cache: LayerCostCache, positions: Sequence[int], table: StageCostTable,
                dp_stages: int, clock: CostClock | None = None) -> list[PipelineCandidate]:
    """The equal-layer and equal-operator splits beside a DP that chose ``dp_stages`` (as
    many stages, or the nearest count that splits evenly: :func:`hand_split_counts`), each
    with its whole-step estimate; [] when no count near it splits evenly."""
    options = stage_dp_options(method, cluster)
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    m = method.num_microbatches
    for count in hand_split_counts(dp_stages):
        try:
            layer_split = uniform_stages(table, count, hosts, per_host, options)
            ops = operator_positions(pp, count)
            # the same count of equal stages: on the equal-layer split's submesh
            ops_table = stage_cost_table(pp, ops, method, cluster, cache, clock,
                                         prefetch_on=(layer_split.stages[0].submesh,),
                                         stage_layers=1)
            op_split = uniform_stages(ops_table, count, hosts, per_host, options)
        except PlanError:
            continue
        if count == dp_stages:
            note = f"{count} stages, as the DP's"
        elif dp_stages == 1:
            note = f"{count} stages (the DP chose one stage: no pipeline)"
        else:
            note = f"{count} stages (the DP's {dp_stages} do not split evenly)"
        out = []
        for name, part, cuts in (("equal-layer", layer_split, positions),
                                 ("equal-operator", op_split, ops)):
            estimate = _estimate(pp, part, cuts, method.schedule, m, 1, cluster, cache)
            out.append(PipelineCandidate(name, part, tuple(cuts), 1, m, cluster, estimate,
                                         note=note))
        return out
    return []


def _partition(method: PipeshardParallel, table: StageCostTable, num_layers: int, hosts: int,
               per_host: int, options: StageDPOptions) -> tuple[StagePartition, int]:
    if isinstance(method.stages, ManualStages):
        shapes = [SubmeshShape(h, d) for h, d in method.stages.submesh_shapes]
        # (manual_stages reads each range as a (start, end) pair)
        return manual_stages(table, method.stages.layer_ranges, shapes, hosts, per_host,
                             options), 1
    if options.schedule == ScheduleName.INTERLEAVED_1F1B or method.stages == StageMode.UNIFORM:
        p = method.num_stages or 2
        v = options.num_chunks
        if num_layers % (p * v):
            raise PlanError(f"{num_layers} layers cannot be cut into {p} stages x {v} chunks "
                            "of equal layers; choose layers as a multiple of stages x chunks")
        return uniform_stages(table, p, hosts, per_host, options), v
    return solve_stages(table, hosts, per_host, options), 1


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


@dataclass
class PipeshardSearch:
    """One schedule's search on a cluster: every pipeline compared (``found``, best first),
    the layer costs it filled, and its seconds by phase (``layers_s`` clustering,
    ``stage_costs_s`` the layers' ILPs, ``stage_dp_s`` the rest of the search)."""

    pp: PipelineProgram
    method: PipeshardParallel
    cluster: ClusterSpec
    cache: LayerCostCache
    graph: OpGraph
    found: list[PipelineCandidate]
    layers_s: float
    stage_costs_s: float
    stage_dp_s: float

    @property
    def best(self) -> PipelineCandidate:
        """The pipeline with the fastest whole-step estimate."""
        return self.found[0]


def search_pipeshard(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec, *,
                     cache: LayerCostCache | None = None) -> PipeshardSearch:
    """Cut ``pp``'s forward into layers and compare every pipeline (``search_pipelines``)
    for ``method``'s one schedule. ``cache``: layer costs to reuse and fill."""
    if method.schedule == SCHEDULE_AUTO:
        raise PlanError("schedule='auto' compares schedules: plan it with "
                        "schedule_choice.plan_pipeline, which searches each with this function")
    start = time.perf_counter()
    check_stage_mesh(method, cluster)
    graph = build_graph(pp.forward)
    positions = layer_positions(pp, graph, method.layers, cluster.num_devices)
    cache = cache if cache is not None else layer_cost_cache(method)
    clock = CostClock()
    searched = time.perf_counter()
    found = search_pipelines(pp, method, cluster, positions, cache, clock)
    solved = time.perf_counter()
    return PipeshardSearch(pp, method, cluster, cache, graph, found, searched - start,
                           clock.seconds, solved - searched - clock.seconds)
