"""Data-parallel planning: batch split over every device, state replicated.

The simplest complete plan, and the baseline every automatic plan must beat: each batch leaf is
split along its first dimension over all mesh axes; parameters and optimizer state are whole on
every device; gradients are all-reduced where the batch split is summed away. Compute is priced
per node as it runs: split work over the devices, the replicated update whole on each.
"""

from __future__ import annotations

from autopar.cluster import format_mesh_shape
from autopar.compiler.cost.estimate import (
    split_compute_time_s,
    summarize_collectives,
    touched_by,
)
from autopar.compiler.cost.memory_model import estimate_memory
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.batch_split import batch_split_inputs, propagate_batch_split
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.planners.common import whole_mesh_plan
from autopar.plan import MethodName, Plan, ShardingSpec


def plan_data_parallel(
    traced: TracedStep,
    mesh: LogicalMesh,
    *,
    batch_argnums: tuple[int, ...],
    cluster_name: str,
    devices_per_host: int,
) -> Plan:
    """Make the data-parallel plan of a traced step on ``mesh`` (raises ``BatchSizeError``)."""
    graph = traced.graph
    n = mesh.num_devices
    all_axes = tuple(mesh.axis_names)
    split_inputs = batch_split_inputs(graph, tuple(batch_argnums), n,
                                      format_mesh_shape(mesh.shape))
    input_specs = {
        io.path: ShardingSpec.split(graph.tensors[io.tensor].ndim, 0, all_axes)
        if io.tensor in split_inputs else ShardingSpec.replicated(graph.tensors[io.tensor].ndim)
        for io in graph.inputs
    }

    result = propagate_batch_split(graph, split_inputs, n)
    output_specs: dict[str, ShardingSpec] = {}
    for io in graph.outputs:
        info = graph.tensors[io.tensor]
        d = result.split_dim.get(io.tensor)
        output_specs[io.path] = (
            ShardingSpec.replicated(info.ndim)
            if d is None
            else ShardingSpec.split(info.ndim, d, all_axes)
        )

    axes = tuple(range(mesh.ndim))
    collectives = summarize_collectives(
        ((c.kind, c.nbytes) for c in result.collectives), mesh, axes
    )
    # a node on the split batch runs on 1/n of it; the rest (the optimizer update on the
    # replicated state) runs whole on every device
    split = touched_by(graph, {t for t, d in result.split_dim.items() if d is not None})
    compute_s = split_compute_time_s(graph, mesh, lambda node: n if split(node) else 1)
    comm_s = sum(c.time_s for c in collectives)

    # every value the batch split reaches is split n ways on every device
    shards = {t: n for t, d in result.split_dim.items() if d is not None}
    memory = estimate_memory(graph, batch_argnums=batch_argnums, shards=shards).breakdown()
    return whole_mesh_plan(
        MethodName.DATA,
        mesh,
        graph,
        cluster_name=cluster_name,
        devices_per_host=devices_per_host,
        batch_argnums=tuple(batch_argnums),
        compute_s=compute_s,
        comm_s=comm_s,
        memory=memory,
        axis_names=all_axes,
        input_shardings=input_specs,
        output_shardings=output_specs,
        collectives=collectives,
    )
