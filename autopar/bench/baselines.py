"""The plans the full search is compared with: one device, data parallelism, the intra-operator
ILP alone and Megatron-LM's tensor parallelism for GPT (the hand-made pipeline splits are the
full search's own candidates: ``planners/pipeline_splits.hand_splits``).

Everything here plans (pure, no devices); running a plan locally is ``autopar.bench.measure``.
"""

from __future__ import annotations

import time
from dataclasses import replace

from autopar.bench.hand_plans import megatron_specs
from autopar.cluster import ClusterSpec
from autopar.compiler.cost.estimate import call_arrays, one_call_time_s
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import TracedStep
from autopar.methods import DataParallel, ShardParallel
from autopar.plan import MethodName, Plan

# Megatron-LM's column/row rules live with the other hand plans (hand_plans.megatron_specs).


def megatron_mesh(cluster: ClusterSpec) -> LogicalMesh:
    """Megatron's layout: tensor parallelism over the devices of a host (the fast links), data
    parallelism across hosts. One host: a 1-D mesh, all of it tensor-parallel."""
    if cluster.num_hosts == 1:
        return LogicalMesh.from_cluster(cluster, (cluster.devices_per_host,))
    return LogicalMesh.from_cluster(cluster, (cluster.num_hosts, cluster.devices_per_host))


def plan_megatron(traced: TracedStep, cluster: ClusterSpec, time_limit_s: float = 30.0) -> Plan:
    """A one-stage plan with every train-state leaf pinned to its Megatron spec (the ILP only
    places the batch and the intermediates). ``ShardParallel`` has no pinning option, so the
    compiler's intra-operator planner is called directly."""
    from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
    from autopar.compiler.planners.shard import plan_shard_parallel

    mesh = megatron_mesh(cluster)
    graph = traced.graph
    pins = megatron_specs(((io.path, graph.tensors[io.tensor].ndim) for io in graph.inputs),
                          mesh.axis_names[-1])
    options = IntraOpOptions(time_limit_s=time_limit_s, batch_argnums=(1,), pinned_inputs=pins)
    start = time.perf_counter()
    plan = plan_shard_parallel(traced, mesh, options, batch_argnums=(1,),
                               cluster_name=cluster.name,
                               devices_per_host=cluster.devices_per_host)
    # one program per step, as every one-stage plan pays (planners/dispatch)
    stage = plan.stages[0]
    runtime = one_call_time_s(cluster.runtime, call_arrays(graph, (1,)),
                              min(mesh.num_devices, cluster.devices_per_host))
    total = stage.est_time_s + runtime
    return replace(plan, est_step_time_s=total).with_planning(
        method_options={"method": MethodName.SHARD.value, "mesh_shape": list(mesh.shape)},
        baseline="megatron",
        estimate={"total_s": total, "compute_s": stage.est_compute_time_s,
                  "communication_s": stage.est_communication_time_s,
                  "runtime_s": runtime},
        planning_time_s=time.perf_counter() - start)


def plan_single_device(traced: TracedStep, cluster: ClusterSpec) -> Plan:
    """The step on one device of ``cluster`` (its compute time: nothing to communicate)."""
    from autopar.compiler.planners.dispatch import plan_traced

    return plan_traced(traced, DataParallel(), cluster.with_devices(1, 1))


def plan_data_parallel(traced: TracedStep, cluster: ClusterSpec) -> Plan:
    """``autopar.DataParallel()`` over every device of ``cluster``."""
    from autopar.compiler.planners.dispatch import plan_traced

    return plan_traced(traced, DataParallel(), cluster)


def plan_intra_op(traced: TracedStep, cluster: ClusterSpec, time_limit_s: float = 30.0) -> Plan:
    """``autopar.ShardParallel()``: the intra-operator ILP on one axis over every device."""
    from autopar.compiler.planners.dispatch import plan_traced

    return plan_traced(traced, ShardParallel(time_limit_s=time_limit_s), cluster)
