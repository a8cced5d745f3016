"""PipeshardParallel planning: the stage search (``pipeline_search``), then the best pipeline's
stages planned (their blocks' plans with the seams priced, or solved whole).

The loss forward is cut into layers (the user's marks or Alpa's clustering). Every layer is
costed by the intra-operator ILP on every submesh shape and logical mesh shape (structurally
identical layers once: ``LayerCostCache``); a stage's cost is the sum of its layers' (Alpa
solves each candidate stage whole; summing layers keeps a 48-layer, 64-device search to a few
dozen small ILPs), with what the runtime adds (accumulation, transfers, the driver's tasks) and
its per-step tail (gradient reduction, update). The search compares the stage DP's answers and
the hand splits on the whole step's estimate; here each stage of the best one has its pieces
planned on its logical mesh (as their blocks' plans where the reshards between blocks keep
that within 1% of the piece's own ILP: ``inter_op.seams``; solved whole otherwise), and that
plan's input shardings are what the runtime places.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.inter_op.forked import available_cores
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.piece_cost import PieceCost
from autopar.compiler.inter_op.remat import (
    is_remat_key,
    is_selective_key,
    state_split_of_key,
)
from autopar.compiler.inter_op.stages import StagePartition, place_submeshes
from autopar.compiler.intra_op.problem import IlpStatus
from autopar.compiler.planners.pipeline_candidate import piece_owners
from autopar.compiler.planners.pipeline_search import PipeshardSearch, search_pipeshard
from autopar.compiler.planners.recompute_report import recompute_notes
from autopar.compiler.planners.stage_costs import (
    range_pieces,
    stage_collectives,
    stage_dp_options,
    submesh_mesh,
)
from autopar.ir.cotangent_marks import contraction_key
from autopar.ir.pieces import Piece
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.repeats import RepeatGrid
from autopar.ir.schedules import ScheduleName
from autopar.methods import PipeshardParallel, StageMode
from autopar.plan import (
    InputSignature,
    MethodName,
    PipelineLayout,
    Plan,
    PlanningRecord,
    StagePlan,
)


def plan_pipeshard(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                   cluster_name: str | None = None, *,
                   cache: LayerCostCache | None = None) -> Plan:
    """Plan ``pp`` (built with ``method.num_microbatches``) on ``cluster``: the search
    (``pipeline_search.search_pipeshard``), then its best pipeline's stages planned
    (:func:`finish_pipeshard`).

    ``cache``: layer costs to reuse and fill (``layer_cost_cache``; default: a fresh one).
    ``plan.planning.phases`` splits the planning seconds: ``layers_s`` (clustering),
    ``stage_costs_s`` (the per-layer ILPs the search asked for), ``stage_dp_s`` (the search
    without them), ``stage_plans_s`` (the chosen stages planned) and ``total_s``.
    ``plan.planning.candidates`` lists the pipelines compared (``search_pipelines``).
    ``schedule="auto"`` is ``schedule_choice.plan_pipeline``'s."""
    return finish_pipeshard(search_pipeshard(pp, method, cluster, cache=cache), cluster_name)


def finish_pipeshard(search: PipeshardSearch, cluster_name: str | None = None) -> Plan:
    """The plan of ``search``'s best pipeline: each stage's pieces as their blocks' plans
    where the reshards at the seams between blocks leave that within 1% of the piece's own
    ILP's optimum (``LayerCostCache.stitched_cost``), else solved whole on the stage's
    logical mesh (one ILP), whose input shardings the runtime places."""
    started = time.perf_counter()
    pp, method, cache, best = search.pp, search.method, search.cache, search.best
    partition, chunks, m, group = best.partition, best.chunks, best.num_microbatches, best.cluster
    positions = list(best.positions)
    hosts, per_host = group.num_hosts, group.devices_per_host
    dp_options = stage_dp_options(method, group, m)
    placed = place_submeshes(list(partition.submeshes), hosts, per_host)
    layout, piece_ranges = _layout(method, partition, positions, chunks, best.replicas)
    layout = _with_checkpoints(layout, cache.grid, len(pp.forward.eqns))
    pieces = range_pieces(pp, positions, piece_ranges)
    versions = [dp_options.weight_versions(s, len(partition.stages))
                for s in range(len(partition.stages))]
    meshes = [submesh_mesh(group, a.submesh, a.candidate.logical_mesh_shape, placed[s])
              for s, a in enumerate(partition.stages)]
    jobs = [(piece, meshes[layout.stage_of_piece[k]],
             state_split_of_key(partition.stages[layout.stage_of_piece[k]].candidate.key))
            for k, piece in enumerate(pieces)]
    # a piece whose blocks' plans, their seams priced, are within 1% of its own ILP's optimum
    # runs them (the plan its estimate priced, but for the seams); the others' ILPs at once,
    # over the planning workers (the search's are done)
    stitched = [cache.stitched_cost(pp, *job) for job in jobs]
    cache.prefetch_whole(pp, [job for job, found in zip(jobs, stitched, strict=True)
                              if found is None], method.time_limit_s,
                         method.planning_workers or available_cores())
    stages = [_stage_plan(search, s, meshes[s], pieces, layout.stage_of_piece, stitched,
                          versions[s])
              for s in range(len(partition.stages))]
    end = time.perf_counter()
    timings = {
        "layers_s": search.layers_s,
        "stage_costs_s": search.stage_costs_s,
        "stage_dp_s": search.stage_dp_s,
        "stage_plans_s": end - started,
        "total_s": search.layers_s + search.stage_costs_s + search.stage_dp_s + end - started,
    }
    notes = _notes(search, stitched, len(pieces)) + recompute_notes(search, meshes, dp_options)
    return _plan(search, stages, layout, timings, notes, cluster_name)


def _plan(search: PipeshardSearch, stages: list[StagePlan], layout: PipelineLayout,
          timings: dict[str, float], notes: list[str], cluster_name: str | None) -> Plan:
    """The plan of the search's best pipeline, its stages planned, with its record."""
    pp, method, cache, best = search.pp, search.method, search.cache, search.best
    partition, m = best.partition, best.num_microbatches
    estimate = best.estimate
    return Plan(
        method=MethodName.PIPESHARD,
        mesh_shape=(len(stages),),
        cluster=cluster_name or search.cluster.name,
        stages=stages,
        est_step_time_s=estimate.total_s,
        total_flops=3.0 * search.graph.total_flops * method.num_microbatches,
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
                "derived_levels": cache.derived_levels,
                "ilp_statuses": dict(sorted(cache.statuses.items())),
                "replicas": best.replicas,
                "microbatches_per_replica": m,
            },
            estimated_idle_fraction=estimate.idle_fraction,
            theoretical_idle_fraction=estimate.theoretical_idle_fraction,
            candidates=[c.summary() | {"chosen": c is best} for c in search.found],
            estimate=estimate.to_dict(),
        ),
        notes=notes,
    )


def _stage_plan(search: PipeshardSearch, s: int, mesh: LogicalMesh, pieces: Sequence[Piece],
                stage_of_piece: Sequence[int], stitched: Sequence[PieceCost | None],
                versions: int) -> StagePlan:
    """Stage ``s`` of the search's best pipeline: its pieces' plans (their blocks' where
    ``stitched``, else solved whole at the method's time limit: this plan is what runs), its
    estimate and memory."""
    pp, method, cache, best = search.pp, search.method, search.cache, search.best
    partition, m = best.partition, best.num_microbatches
    assignment = partition.stages[s]
    c = assignment.candidate
    specs, values, cotangents, contractions, compute, costs = {}, {}, {}, {}, 0.0, []
    for k, piece in enumerate(pieces):
        if stage_of_piece[k] != s:
            continue
        cost = stitched[k] or cache.cost(pp, piece, mesh, time_limit_s=method.time_limit_s,
                                         split=state_split_of_key(c.key))
        specs.update(cost.input_specs)
        values.update(cost.value_specs)
        cotangents.update(cost.cotangent_specs)
        contractions.update({contraction_key(key): spec
                             for key, spec in cost.contraction_specs.items()})
        compute += cost.compute_s
        costs.append(cost)
    compute = min(compute, c.time)
    dp_options = stage_dp_options(method, best.cluster, m)
    return StagePlan(
        index=s,
        layers=tuple(range(assignment.start, assignment.end)),
        submesh_shape=(assignment.submesh.num_hosts, assignment.submesh.devices_per_host),
        logical_mesh_shape=tuple(c.logical_mesh_shape),
        axis_names=tuple(mesh.axis_names),
        device_ids=tuple(mesh.device_ids),
        input_shardings=_input_paths(pp, specs),
        # what the pieces compute, and what they read (which the runtime places so)
        tensor_shardings=values | specs,
        cotangent_shardings=cotangents,
        contraction_shardings=contractions,
        collectives=stage_collectives(costs, m),
        est_time_s=c.time,
        est_compute_time_s=compute,
        est_communication_time_s=c.time - compute,
        peak_memory_bytes=int(c.memory(dp_options.in_flight(s, len(partition.stages)),
                                       versions)),
        memory_breakdown={"fixed": int(c.fixed_memory),
                          "activations_per_microbatch": int(c.activation_memory_per_microbatch),
                          # the versions past the one "fixed" holds (asynchronous)
                          "stashed_weights": int((versions - 1) * c.param_bytes)},
    )


def _notes(search: PipeshardSearch, stitched: Sequence[PieceCost | None],
           num_pieces: int) -> list[str]:
    """What the plan says about how its pipeline was found and its stages planned."""
    method, best = search.method, search.best
    notes = []
    if not best.partition.exact:
        notes.append("stage search thinned its stage-time caps: not proven optimal")
    if method.schedule == ScheduleName.INTERLEAVED_1F1B and method.stages == StageMode.AUTO:
        notes.append("interleaved-1f1b uses uniform stages (equal layers on equal submeshes)")
    if best.name.startswith("equal-"):
        notes.append(f"the {best.name} split ({best.note}) is estimated faster than the stage "
                     "DP's own stages on the whole step, so it is the plan")
    if best.replicas > 1:
        notes.append(f"the pipeline runs as {best.replicas} data-parallel replicas, each on "
                     f"{best.cluster.num_hosts} host(s) with {best.num_microbatches} of the "
                     f"{method.num_microbatches} microbatches; the replicas all-reduce each "
                     "stage's gradients between hosts")
    kept = [found for found in stitched if found is not None]
    if kept:
        gaps = [found.ilp_gap or 0.0 for found in kept]
        notes.append(f"{len(kept)} of {num_pieces} stage pieces run their repeated blocks' "
                     "plans (the plans the stage search priced them by), the reshards where one "
                     "block passes another a value in another layout priced: within "
                     f"{max(gaps):.2%} of each piece's own ILP's optimum"
                     + ("; the rest were solved whole" if len(kept) < num_pieces else ""))
    notes.extend(stage_ilp_notes(search.cache))
    return notes


def stage_ilp_notes(cache: LayerCostCache) -> list[str]:
    """Notes counting the stage-cost ILPs that did not end proven optimal."""
    statuses = cache.statuses
    total = sum(statuses.values())
    notes = []
    stopped = statuses.get(IlpStatus.TIME_LIMIT, 0)
    if stopped:
        notes.append(f"{stopped} of {total} stage-cost ILPs stopped at their time limit "
                     f"({cache.options.time_limit_s:g} s): their best plan so far is used, "
                     "not proven optimal")
    within = statuses.get("within_gap", 0)
    if within:
        notes.append(f"{within} of {total} stage-cost ILPs stopped within their relative gap "
                     f"({cache.options.relative_gap:g}) of the optimum")
    for status, what in ((IlpStatus.NO_SOLUTION, "found no plan in time"),
                         (IlpStatus.SOLVER_ERROR, "failed")):
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


def _with_checkpoints(layout: PipelineLayout, grid: RepeatGrid | None,
                      num_eqns: int) -> PipelineLayout:
    """``layout`` with its recomputed stages checkpointed per repeated block: every layer cut
    and the block boundaries inside the layers, the blocks the stage search costed each
    layer by (``LayerCostCache.units``), so that the runtime keeps what the plan's memory
    counts (each block's inputs, one block's activations rebuilt at a time)."""
    if grid is None or not any(layout.remat_stages):
        return layout
    cuts = sorted(set(layout.layer_positions) | set(grid.cuts_within(0, num_eqns)))
    return replace(layout, checkpoint_positions=tuple(c for c in cuts if c > 0))


def _layout(method: PipeshardParallel, partition: StagePartition, positions: Sequence[int],
            chunks: int, replicas: int = 1) -> tuple[PipelineLayout, list[tuple[int, int]]]:
    owner, ranges = piece_owners(len(partition.stages), chunks, partition, positions)
    cuts = [positions[a - 1] for a, _ in ranges[1:]]
    remat = tuple(is_remat_key(st.candidate.key) for st in partition.stages)
    selective = tuple(is_selective_key(st.candidate.key) for st in partition.stages)
    # a schedule by name here: "auto" was resolved by ``schedule_choice`` before planning
    layout = PipelineLayout(ScheduleName(method.schedule), chunks, tuple(positions),
                            tuple(cuts), tuple(owner), remat, replicas,
                            selective if any(selective) else ())
    return layout, ranges
