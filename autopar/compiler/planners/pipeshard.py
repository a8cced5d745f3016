"""PipeshardParallel planning: layers, the stage DP over per-layer ILP costs, stage plans.

The loss forward is cut into layers (the user's marks or Alpa's clustering). Every layer is
costed by the intra-operator ILP on every submesh shape and logical mesh shape (structurally
identical layers once: ``LayerCostCache``); a stage's cost is the sum of its layers' (Alpa
solves each candidate stage whole; summing layers keeps a 48-layer, 64-device search to a few
dozen small ILPs), with what the runtime adds (accumulation, transfers, the driver's tasks) and
its per-step tail (gradient reduction, update). The stage DP picks layer ranges and submeshes,
on the whole cluster and, on several hosts, per replica count (the pipeline replicated over
groups of hosts); its answers and the equal-layer and equal-operator splits are judged by the
whole step's estimate (``inter_op/pipeline_cost``) and the best is the plan. Each chosen
stage's pieces are then solved whole on their logical mesh, and that plan's input shardings are
what the runtime places.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.pipeline_cost import (
    PipelineEstimate,
    driver_counts,
    estimate_pipeline,
)
from autopar.compiler.inter_op.remat import is_lean_key, is_remat_key
from autopar.compiler.inter_op.stages import (
    StageCostTable,
    StageDPOptions,
    StagePartition,
    SubmeshShape,
    manual_stages,
    place_submeshes,
    solve_stages,
    uniform_stages,
)
from autopar.compiler.inter_op.step_parts import step_work
from autopar.compiler.planners.stage_costs import (
    CostClock,
    check_stage_mesh,
    layer_cost_cache,
    range_piece,
    stage_collectives,
    stage_cost_table,
    stage_dp_options,
    submesh_mesh,
)
from autopar.errors import PlanError
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.schedules import ScheduleName
from autopar.methods import SCHEDULE_AUTO, ManualStages, PipeshardParallel
from autopar.plan import (
    InputSignature,
    MethodName,
    PipelineLayout,
    Plan,
    PlanningRecord,
    StagePlan,
)


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
    """Cuts of the loss forward into ``num_stages`` pieces of equal operator counts."""
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
    owner, ranges = _owners(len(partition.stages), chunks, partition, positions)
    pieces = [range_piece(pp, positions, a, b) for a, b in ranges]
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
    if method.replicas == "none" or method.stages != "auto" \
            or method.schedule == ScheduleName.INTERLEAVED_1F1B:
        return [1]
    hosts, m = cluster.num_hosts, method.num_microbatches
    return [r for r in range(1, hosts + 1) if hosts % r == 0 and m % r == 0]


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
        label = "stage DP" if method.stages == "auto" else f"stages={method.stages!r}"
        if isinstance(method.stages, ManualStages):
            label = "manual stages"
        where = f" x {r} replicas of {hosts} host(s)" if r > 1 else ""
        found.append(PipelineCandidate(
            f"{label}{where}", partition, tuple(positions), r, m, group,
            _estimate(pp, partition, positions, method.schedule, m, chunks, group, cache),
            chunks))
        if r > 1 or method.stages != "auto" or method.schedule == \
                ScheduleName.INTERLEAVED_1F1B:
            continue
        for split in hand_splits(pp, method, group, cache, positions, table,
                                 len(partition.stages), clock):
            found.append(split)
    if not found and last_error is not None:
        raise last_error
    return sorted(found, key=lambda c: c.estimate.total_s)


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
                                         prefetch_on=(layer_split.stages[0].submesh,))
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


def plan_pipeshard(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                   cluster_name: str | None = None, *,
                   cache: LayerCostCache | None = None) -> Plan:
    """Plan ``pp`` (built with ``method.num_microbatches``) on ``cluster``.

    ``cache``: layer costs to reuse and fill (``layer_cost_cache``; default: a fresh one).
    ``plan.planning.phases`` splits the planning seconds: ``layers_s`` (clustering),
    ``stage_costs_s`` (the per-layer ILPs the search asked for), ``stage_dp_s`` (the search
    without them), ``stage_plans_s`` (the chosen stages solved whole) and ``total_s``.
    ``plan.planning.candidates`` lists the pipelines compared (``search_pipelines``).
    ``schedule="auto"`` is ``schedule_choice.plan_pipeline``'s."""
    if method.schedule == SCHEDULE_AUTO:
        raise PlanError("schedule='auto' compares schedules: plan it with "
                        "schedule_choice.plan_pipeline, which plans each with this function")
    start = time.perf_counter()
    check_stage_mesh(method, cluster)
    graph = build_graph(pp.forward)
    positions = layer_positions(pp, graph, method.layers, cluster.num_devices)
    cache = cache if cache is not None else layer_cost_cache(method)
    clock = CostClock()
    searched = time.perf_counter()
    found = search_pipelines(pp, method, cluster, positions, cache, clock)
    best = found[0]
    solved = time.perf_counter()
    partition, chunks, m, group = best.partition, best.chunks, best.num_microbatches, best.cluster
    positions = list(best.positions)
    hosts, per_host = group.num_hosts, group.devices_per_host
    dp_options = stage_dp_options(method, group, m)
    placed = place_submeshes(list(partition.submeshes), hosts, per_host)
    layout, piece_ranges = _layout(method, partition, positions, chunks, best.replicas)
    pieces = [range_piece(pp, positions, a, b) for a, b in piece_ranges]
    versions = [dp_options.weight_versions(s, len(partition.stages))
                for s in range(len(partition.stages))]
    stages = []
    for s, assignment in enumerate(partition.stages):
        shape = assignment.candidate.logical_mesh_shape
        mesh = submesh_mesh(group, assignment.submesh, shape, placed[s])
        specs, values, compute, costs = {}, {}, 0.0, []
        for k, piece in enumerate(pieces):
            if layout.stage_of_piece[k] == s:
                # what runs: one ILP, not its blocks' (docs/algorithms.md), at the method's limit
                cost = cache.cost(pp, piece, mesh, time_limit_s=method.time_limit_s,
                                  lean=is_lean_key(assignment.candidate.key))
                specs.update(cost.input_specs)
                values.update(cost.value_specs)
                compute += cost.compute_s
                costs.append(cost)
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
            # what the pieces compute, and what they read (which the runtime places so)
            tensor_shardings=values | specs,
            collectives=stage_collectives(costs, m),
            est_time_s=c.time,
            est_compute_time_s=compute,
            est_communication_time_s=c.time - compute,
            peak_memory_bytes=int(c.memory(dp_options.in_flight(s, len(partition.stages)),
                                           versions[s])),
            memory_breakdown={"fixed": int(c.fixed_memory),
                              "activations_per_microbatch":
                                  int(c.activation_memory_per_microbatch),
                              # the versions past the one "fixed" holds (asynchronous)
                              "stashed_weights": int((versions[s] - 1) * c.param_bytes)},
        ))
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
    if best.name.startswith("equal-"):
        notes.append(f"the {best.name} split ({best.note}) is estimated faster than the stage "
                     "DP's own stages on the whole step, so it is the plan")
    if best.replicas > 1:
        notes.append(f"the pipeline runs as {best.replicas} data-parallel replicas, each on "
                     f"{hosts} host(s) with {m} of the {method.num_microbatches} microbatches; "
                     "the replicas all-reduce each stage's gradients between hosts")
    notes.extend(stage_ilp_notes(cache))
    estimate = best.estimate
    return Plan(
        method=MethodName.PIPESHARD,
        mesh_shape=(len(stages),),
        cluster=cluster_name or cluster.name,
        stages=stages,
        est_step_time_s=estimate.total_s,
        total_flops=3.0 * graph.total_flops * method.num_microbatches,
        num_microbatches=method.num_microbatches,
        signature=[
            InputSignature(path, tuple(int(d) for d in pp.outer.avals[v].shape),
                           str(pp.outer.avals[v].dtype))
            for v, path in zip(pp.outer.in_ids, pp.outer.in_paths, strict=True)
        ],
        pipeline=layout,
        planning=PlanningRecord(
            planning_time_s=timings["total_s"],
            phases=timings,
            stage_search=partition.to_dict() | {
                "ilp_solves": cache.ilp_solves,
                "ilp_statuses": dict(sorted(cache.statuses.items())),
                "replicas": best.replicas,
                "microbatches_per_replica": m,
            },
            estimated_idle_fraction=estimate.idle_fraction,
            theoretical_idle_fraction=estimate.theoretical_idle_fraction,
            candidates=[c.summary() | {"chosen": c is best} for c in found],
            estimate=estimate.to_dict(),
        ),
        notes=notes,
    )


def stage_ilp_notes(cache: LayerCostCache) -> list[str]:
    """Notes counting the stage-cost ILPs that did not end proven optimal."""
    statuses = cache.statuses
    total = sum(statuses.values())
    notes = []
    stopped = statuses.get("time_limit", 0)
    if stopped:
        notes.append(f"{stopped} of {total} stage-cost ILPs stopped at their time limit "
                     f"({cache.options.time_limit_s:g} s): their best plan so far is used, "
                     "not proven optimal")
    within = statuses.get("within_gap", 0)
    if within:
        notes.append(f"{within} of {total} stage-cost ILPs stopped within their relative gap "
                     f"({cache.options.relative_gap:g}) of the optimum")
    for status, what in (("no_solution", "found no plan in time"),
                         ("solver_error", "failed")):
        if statuses.get(status):
            notes.append(f"{statuses[status]} of {total} stage-cost ILPs: the solver {what}; "
                         "the greedy plan is used for them")
    return notes


def _input_paths(pp: PipelineProgram, specs: dict) -> dict:
    """The specs of loss inputs that are step inputs (parameters, batch leaves), or slices of
    stacked ones, by path."""
    outer = pp.outer
    path_of = dict(zip(outer.in_ids, outer.in_paths, strict=True))
    for i in pp.input_splits:  # a slice of a stacked input (a scan's layer): ``path[layer]``
        e = outer.eqns[i]
        path_of[e.outputs[0]] = f"{path_of[e.inputs[0]]}[{e.params['start_indices'][0]}]"
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


def _owners(p: int, chunks: int, partition: StagePartition,
            positions: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The stage owning each piece, and each piece's layer range."""
    num_layers = len(positions) + 1
    if chunks == 1:
        return list(range(p)), [(st.start, st.end) for st in partition.stages]
    # p * v equal pieces; piece k runs on stage k mod p (Megatron's mapping)
    size = num_layers // (p * chunks)
    return ([k % p for k in range(p * chunks)],
            [(k * size, (k + 1) * size) for k in range(p * chunks)])


def _layout(method: PipeshardParallel, partition: StagePartition, positions: Sequence[int],
            chunks: int, replicas: int = 1) -> tuple[PipelineLayout, list[tuple[int, int]]]:
    owner, ranges = _owners(len(partition.stages), chunks, partition, positions)
    cuts = [positions[a - 1] for a, _ in ranges[1:]]
    remat = tuple(is_remat_key(st.candidate.key) for st in partition.stages)
    layout = PipelineLayout(method.schedule, chunks, tuple(positions), tuple(cuts), tuple(owner),
                            remat, replicas)
    return layout, ranges
