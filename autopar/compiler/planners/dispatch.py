"""The compiler's entry point: traced step + method + cluster -> Plan (pure, no devices)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from autopar.cluster import ClusterSpec, format_mesh_shape
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.planners.data import plan_data_parallel
from autopar.compiler.planners.zero import optimizer_state_pins, plan_zero
from autopar.errors import InvalidOptionError, MeshError
from autopar.methods import DataParallel, Method, ShardParallel, Zero2Parallel, Zero3Parallel
from autopar.plan import Plan


def mesh_shape_choices(num_devices: int) -> list[str]:
    """Valid 1-D and 2-D mesh shapes for ``num_devices`` devices, for error messages."""
    shapes = [str(num_devices)]
    shapes += [f"{a}x{num_devices // a}" for a in range(1, num_devices + 1) if num_devices % a == 0]
    return shapes


def logical_mesh_for(cluster: ClusterSpec, mesh_shape: tuple[int, ...] | None) -> LogicalMesh:
    """The logical mesh over the whole cluster (default: one axis over all its devices)."""
    n = cluster.num_devices
    shape = tuple(mesh_shape) if mesh_shape else (n,)
    count = 1
    for d in shape:
        count *= d
    if count != n:
        raise MeshError(
            f"mesh shape {format_mesh_shape(shape)} covers {count} devices but the cluster "
            f"'{cluster.name}' has {n}; valid shapes: {', '.join(mesh_shape_choices(n))}"
        )
    return LogicalMesh.from_cluster(cluster, shape)


def plan_step(
    traced: TracedStep,
    method: Method,
    cluster: ClusterSpec,
    *,
    batch_argnums: tuple[int, ...] = (1,),
    ilp_observer: Callable[[Any, Any], None] | None = None,
) -> Plan:
    """Plan ``traced`` with ``method`` on ``cluster``; records the planning time in the plan.

    ``ilp_observer(problem, solution)`` is called with each intra-operator ILP solved (for
    ``--dump-ilp``).
    """
    start = time.perf_counter()
    if isinstance(method, ShardParallel):
        # imported here: the ILP stack (PuLP, strategies) loads only when a plan needs it
        from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
        from autopar.compiler.planners.shard import plan_shard_parallel

        mesh = logical_mesh_for(cluster, method.mesh_shape)
        pins = (optimizer_state_pins(traced.graph, mesh, tuple(batch_argnums))
                if method.prefer_reduce_scatter else {})

        def solve_within(budget: float | None) -> Plan:
            return plan_shard_parallel(
                traced,
                mesh,
                IntraOpOptions(
                    memory_budget_bytes=budget,
                    solver=method.solver,
                    time_limit_s=method.time_limit_s,
                    batch_argnums=tuple(batch_argnums),
                    pinned_inputs=pins,
                ),
                batch_argnums=batch_argnums,
                cluster_name=cluster.name,
                devices_per_host=cluster.devices_per_host,
                ilp_observer=ilp_observer,
            )

        plan = solve_within(method.memory_budget_bytes)
        device_memory = cluster.device.memory_bytes
        if method.memory_budget_bytes is None and plan.peak_memory_bytes > device_memory:
            # the device's memory is the default budget; the memory rows make the ILP slower,
            # so they are added only when the unconstrained plan does not fit
            plan = solve_within(float(device_memory))
            plan.notes.append(
                f"the fastest plan did not fit the device's {device_memory / 2**30:.1f} GiB; "
                "solved again with that as the per-device memory budget"
            )
    elif isinstance(method, DataParallel):
        mesh = logical_mesh_for(cluster, method.mesh_shape)
        plan = plan_data_parallel(
            traced,
            mesh,
            batch_argnums=batch_argnums,
            cluster_name=cluster.name,
            devices_per_host=cluster.devices_per_host,
        )
    elif isinstance(method, Zero2Parallel | Zero3Parallel):
        mesh = logical_mesh_for(cluster, method.mesh_shape)
        plan = plan_zero(
            traced,
            mesh,
            stage=2 if isinstance(method, Zero2Parallel) else 3,
            batch_argnums=batch_argnums,
            cluster_name=cluster.name,
            devices_per_host=cluster.devices_per_host,
        )
    else:
        raise InvalidOptionError(
            f"unknown method {type(method).__name__}; valid methods: DataParallel, "
            "ShardParallel, Zero2Parallel, Zero3Parallel"
        )
    plan.options = {"method": method.name, "mesh_shape": list(mesh.shape)}
    plan.options["planning_time_s"] = time.perf_counter() - start
    return plan
