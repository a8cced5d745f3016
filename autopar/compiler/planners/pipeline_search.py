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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.pipeline_cost import least_driver_counts
from autopar.compiler.inter_op.stages import (
    StageCostTable,
    StageDPOptions,
    StagePartition,
    SubmeshShape,
    manual_stages,
    solve_stages,
    uniform_stages,
)
from autopar.compiler.planners.pipeline_candidate import (
    PipelineCandidate,
    estimate_candidate,
    forward_graph,
)
from autopar.compiler.planners.pipeline_splits import deep_equal_splits, hand_splits
from autopar.compiler.planners.stage_costs import (
    check_stage_mesh,
    layer_cost_cache,
    stage_dp_options,
)
from autopar.compiler.planners.stage_table import CostClock, stage_cost_table
from autopar.errors import PlanError
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.schedules import ScheduleName, is_async
from autopar.methods import (
    SCHEDULE_AUTO,
    ManualStages,
    PipeshardParallel,
    ReplicaMode,
    StageMode,
)


def replica_counts(method: PipeshardParallel, cluster: ClusterSpec) -> list[int]:
    """How many data-parallel replicas of the pipeline the search tries: 1, and every count
    of equal groups of whole hosts that also divides the microbatches (each replica runs
    ``m / r`` of them), when the stages are the DP's own (not uniform, manual, interleaved)."""
    if method.replicas == ReplicaMode.NONE or method.stages != StageMode.AUTO \
            or method.schedule == ScheduleName.INTERLEAVED_1F1B:
        return [1]
    hosts, m = cluster.num_hosts, method.num_microbatches
    return [r for r in range(1, hosts + 1) if hosts % r == 0 and m % r == 0]


def driver_floor_s(pp: PipelineProgram, method: PipeshardParallel,
                   cluster: ClusterSpec) -> float:
    """The least host time the estimate gives any pipeline of two or more stages of ``pp``:
    the operations its driver issues whatever the stages (``least_driver_counts``: each
    stage's forward and backward task per microbatch, each microbatch's batch slices and loss
    outputs placed, the parameters fetched, their gradients sent home, the update's segments
    and what they read), with ``m / r`` microbatches on each of ``r`` replicas' drivers, under
    the method's schedule (or any ``schedule="auto"`` compares). A one-stage plan estimated
    below it leaves such pipelines nothing to win."""
    per_driver = method.num_microbatches // max(replica_counts(method, cluster))
    asynchronous = is_async(method.schedule) or (method.schedule == SCHEDULE_AUTO
                                                 and method.allow_async)
    return least_driver_counts(pp, per_driver, asynchronous).seconds(cluster.runtime)


def search_pipelines(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                     positions: Sequence[int], cache: LayerCostCache,
                     clock: CostClock) -> list[PipelineCandidate]:
    """Every pipelined plan the search compares, best first: the stage DP's on the whole
    cluster and, per replica count, on each group of hosts; beside the DP's own, the
    equal-layer and equal-operator splits (the stage DP's formula is Alpa's, the candidates
    are judged by the whole-step estimate, so a hand split can win: then it is the plan).

    The equal-operator split's layers are new pieces, whose ILPs are forked: the other
    replica counts' DPs, which read only the layers solved already, run here meanwhile
    (at GPT-3 175B on 1,024 GPUs: six DPs, 1.5 s, beside 5 s of ILPs)."""
    num_layers = len(positions) + 1

    def replicated(r: int) -> tuple[PipelineCandidate, StageCostTable] | None:
        group = cluster.with_hosts(cluster.num_hosts // r)
        m = method.num_microbatches // r
        hosts, per_host = group.num_hosts, group.devices_per_host
        options = stage_dp_options(method, group, m)
        table = stage_cost_table(pp, positions, method, group, cache, clock,
                                 num_microbatches=m, replicas=r, whole=cluster)
        try:
            partition, chunks = _partition(method, table, num_layers, hosts, per_host, options)
        except PlanError:
            if r == 1:
                raise
            return None  # no pipeline of that many replicas fits
        where = f" x {r} replicas of {hosts} host(s)" if r > 1 else ""
        return PipelineCandidate(
            f"{_label(method)}{where}", partition, tuple(positions), r, m, group,
            estimate_candidate(pp, partition, positions, method.schedule, m, chunks, group, cache),
            chunks), table

    counts = replica_counts(method, cluster)
    replicas: list[PipelineCandidate] = []

    def rest() -> None:
        for r in counts[1:]:
            made = replicated(r)
            if made is not None:
                replicas.append(made[0])

    first = replicated(counts[0])
    assert first is not None, "one replica raises rather than return nothing"
    single, table = first
    found = [single]
    if method.stages == StageMode.AUTO and method.schedule != ScheduleName.INTERLEAVED_1F1B:
        found += _beside(cache, clock, rest, lambda: hand_splits(
            pp, method, single.cluster, cache, positions, table,
            len(single.partition.stages), clock))
    else:
        rest()
    found += replicas
    if method.stages == StageMode.AUTO and method.schedule != ScheduleName.INTERLEAVED_1F1B:
        best = min((c.estimate.total_s for c in found), default=math.inf)
        found.extend(deep_equal_splits(pp, method, cluster, cache, num_layers, clock,
                                       beat=best))
    return sorted(found, key=lambda c: c.estimate.total_s)


def _label(method: PipeshardParallel) -> str:
    if isinstance(method.stages, ManualStages):
        return "manual stages"
    return "stage DP" if method.stages == StageMode.AUTO else f"stages='{method.stages}'"


def _beside(cache: LayerCostCache, clock: CostClock, work: Callable[[], None],
            forking: Callable[[], list[PipelineCandidate]]) -> list[PipelineCandidate]:
    """``forking()``, with ``work()`` done by this process while the ILPs it forks run (else
    after it); ``work``'s seconds are left out of ``clock`` (they are the DP's)."""
    spent = 0.0

    def timed() -> None:
        nonlocal spent
        began = time.perf_counter()
        try:
            work()
        finally:
            spent = time.perf_counter() - began

    if cache.meanwhile is not None:  # the caller's own work waits for the first fork
        out = forking()
        work()
        return out
    cache.meanwhile = timed
    try:
        out = forking()
    finally:
        pending, cache.meanwhile = cache.meanwhile is timed, None
    if pending:  # nothing was forked
        work()
    else:  # the DP's seconds, though the table that forked counted them
        clock.seconds -= spent
    return out


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
    cache = cache if cache is not None else layer_cost_cache(method)
    graph = forward_graph(pp, cache)
    positions = layer_positions(pp, graph, method.layers, cluster.num_devices)
    clock = CostClock()
    searched = time.perf_counter()
    found = search_pipelines(pp, method, cluster, positions, cache, clock)
    solved = time.perf_counter()
    return PipeshardSearch(pp, method, cluster, cache, graph, found, searched - start,
                           clock.seconds, solved - searched - clock.seconds)

