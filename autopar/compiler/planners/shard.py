"""ShardParallel planning: the intra-operator ILP's choice, written as a Plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopar.compiler.cost.attention_blocks import transient_bytes
from autopar.compiler.cost.estimate import launch_time_s, summarize_collectives
from autopar.compiler.cost.host_state import HostState, host_state, host_transfer_s
from autopar.compiler.cost.memory_model import estimate_memory
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.intra_op.problem import IlpStatus
from autopar.compiler.intra_op.sharding_ilp import (
    LEAST_MEMORY,
    IntraOpOptions,
    IntraOpResult,
    MeshCaches,
    solve_intra_op,
)
from autopar.compiler.planners.common import whole_mesh_plan
from autopar.plan import MethodName, Plan, ShardingSpec


def _collectives(result: IntraOpResult, mesh: LogicalMesh):
    """Every predicted collective: the chosen strategies' own and the resharding ones, grouped
    per (kind, axes) into one estimate each."""
    found = [c for s in result.node_strategy.values() for c in s.collectives]
    found += result.reshard_collectives
    by_axes: dict[tuple[int, ...], list] = {}
    for c in found:
        by_axes.setdefault(c.axes, []).append(c)
    out = []
    for axes, items in sorted(by_axes.items()):
        grouped = summarize_collectives(
            ((c.kind, c.nbytes) for c in items for _ in range(c.count)), mesh, axes
        )
        out.extend(grouped)
    return out


def plan_shard_parallel(
    traced: TracedStep,
    mesh: LogicalMesh,
    options: IntraOpOptions,
    *,
    batch_argnums: tuple[int, ...],
    cluster_name: str,
    devices_per_host: int,
    ilp_observer: Callable[[Any, Any], None] | None = None,
    built: dict | None = None,
    caches: MeshCaches | None = None,
) -> Plan:
    """Solve the sharding ILP for ``traced`` on ``mesh`` and return the plan. ``built``: the
    problems built so far for this step (``solve_intra_op``), to solve one again under a
    memory budget. ``caches``: strategy lists, resharding costs and edge matrices shared with
    other builds on this same mesh (``MeshCaches``; pinned inputs key their own lists, so
    solves with and without pins may share them)."""
    graph = traced.graph
    result = solve_intra_op(graph, mesh, options, caches=caches, built=built)
    if ilp_observer is not None:
        ilp_observer(result.problem, result.solution)
    sizes = {a: mesh.axis_size(a) for a in mesh.axis_names}
    input_specs, output_specs, tensor_specs = _layouts(graph, result)
    collectives = _collectives(result, mesh)
    compute_s = sum(s.compute_time_s for s in result.node_strategy.values()) + \
        launch_time_s(graph, mesh)
    comm_s = sum(c.time_s for c in collectives)
    shard_count = {t: spec.num_shards(sizes) for t, spec in result.tensor_spec.items()}
    transient = transient_bytes(graph, result.node_strategy, result.operand_specs,
                                shard_count, sizes)
    memory = estimate_memory(graph, batch_argnums=batch_argnums, shards=shard_count,
                             resharded=transient,
                             host=options.host_tensors(graph)).breakdown()
    notes = _notes(result, mesh)
    hosted = host_state(graph, batch_argnums) if options.offload_optimizer_state else None
    if hosted:
        comm_s += _host_note(graph, hosted, shard_count, mesh, notes)
    return whole_mesh_plan(
        MethodName.SHARD,
        mesh,
        graph,
        cluster_name=cluster_name,
        devices_per_host=devices_per_host,
        batch_argnums=tuple(batch_argnums),
        compute_s=compute_s,
        comm_s=comm_s,
        memory=memory,
        solver=_solver_stats(result, graph),
        notes=notes,
        input_shardings=input_specs,
        output_shardings=output_specs,
        tensor_shardings=tensor_specs,
        operand_shardings=dict(result.operand_specs),
        collectives=collectives,
        host_paths=(hosted.input_paths + hosted.output_paths) if hosted else (),
    )


def _solver_stats(result: IntraOpResult, graph: OpGraph) -> dict[str, Any]:
    """How the ILP was built and solved, for the plan's record."""
    solution = result.solution
    return solution.to_dict() | {
        "build_time_s": result.build_time_s + solution.build_time_s,
        "variables_before_merging": graph.num_nodes + len(graph.inputs),
        "decision_variables": len(result.variables),
    }


def _host_note(graph: OpGraph, hosted: HostState, shards: dict[int, int], mesh: LogicalMesh,
               notes: list[str]) -> float:
    """Seconds a step moving the optimizer state kept in host memory over the host link
    (``cost.host_state``), and a note saying so."""
    moved = host_transfer_s(graph, hosted, shards, mesh.device.host_link_bytes_per_s)
    notes.append(f"optimizer state kept in host memory between steps: {len(hosted.inputs)} "
                 f"leaves, {moved:.4g} s a step over the host link (in for the update, out "
                 "after it)")
    return moved


def _layouts(graph: OpGraph, result: IntraOpResult
             ) -> tuple[dict[str, ShardingSpec], dict[str, ShardingSpec], dict[int, ShardingSpec]]:
    """The solved plan's input and output layouts by path (an output tied to an input, the
    next step's state, leaves as that input came) and every computed tensor's layout."""
    input_specs = {io.path: result.input_spec[io.tensor] for io in graph.inputs}
    ties = dict(result.ties)
    output_specs: dict[str, ShardingSpec] = {}
    for io in graph.outputs:
        spec = result.input_spec.get(ties.get(io.tensor, -1)) or result.tensor_spec.get(io.tensor)
        output_specs[io.path] = spec or ShardingSpec.replicated(graph.tensors[io.tensor].ndim)
    tensor_specs = {
        t: spec
        for node in graph.nodes
        for t, spec in zip(node.outputs, result.node_strategy[node.id].output_specs, strict=True)
        if graph.tensors[t].ndim > 0
    }
    return input_specs, output_specs, tensor_specs


def _notes(result: IntraOpResult, mesh: LogicalMesh) -> list[str]:
    """What the plan says about its mesh axes and how its ILP ended."""
    solution = result.solution
    notes: list[str] = []
    used = {a for spec in result.tensor_spec.values() for axes in spec.dims for a in axes}
    for axis, size in zip(mesh.axis_names, mesh.shape, strict=True):
        if size > 1 and axis not in used:
            notes.append(
                f"mesh axis '{axis}' (size {size}) splits no tensor: no dimension it divides "
                "was worth splitting, so its devices hold replicas"
            )
    if solution.status == IlpStatus.NO_SOLUTION:
        notes.append(f"the ILP solver ({solution.solver}) found no plan within its time limit: "
                     "the greedy plan is used, not proven optimal")
    elif solution.status == IlpStatus.SOLVER_ERROR:
        notes.append(f"the ILP solver ({solution.solver}) failed (see the warning logged): "
                     "the greedy plan is used, not proven optimal")
    elif solution.status == LEAST_MEMORY:
        notes.append("the memory rows of the ILP admitted no plan within the memory budget; "
                     "the least-memory plan, which the memory model finds within it, is used")
    elif not solution.proven_optimal and solution.status != IlpStatus.TRIVIAL:
        notes.append(f"ILP stopped at its time limit ({solution.status}): not proven optimal")
    return notes
