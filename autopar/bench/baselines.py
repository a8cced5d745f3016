"""The plans the full search is compared with: one device, data parallelism, the intra-operator
ILP alone, Megatron-LM's tensor parallelism for GPT, and the usual hand-made pipeline splits.

Everything here plans (pure, no devices); running a plan locally is ``autopar.bench.measure``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.stages import StagePartition
from autopar.errors import PlanError
from autopar.ir.pipeline_program import PipelineProgram
from autopar.methods import DataParallel, PipeshardParallel, ShardParallel
from autopar.plan import Plan, ShardingSpec

# Megatron-LM's split of a transformer block (Shoeybi et al. 2019): the first matmul of each
# pair is column-parallel (kernel split on its output dimension, bias split alike), the second
# row-parallel (kernel split on its input dimension, bias whole: added after the all-reduce).
COLUMN_PARALLEL: tuple[str, ...] = ("attn/q", "attn/k", "attn/v", "mlp/fc_in")
ROW_PARALLEL: tuple[str, ...] = ("attn/out", "mlp/fc_out")
_BLOCK_LEAF = re.compile(r"/blocks/\d+/(\w+/\w+)/(kernel|bias)$")
# The train state: parameters and Adam's moments (the moments take the parameter's layout,
# as Megatron's distributed optimizer keeps them; the update is elementwise).
_STATE_PREFIX = "state/"


def megatron_specs(leaves: Iterable[tuple[str, int]], axis: str) -> dict[str, ShardingSpec]:
    """The spec of every train-state leaf ``(path, ndim)`` under Megatron's tensor parallelism
    over mesh axis ``axis``: q/k/v/fc_in column-parallel, out/fc_out row-parallel, everything
    else in the state (embeddings, layer norms, Adam's step count) replicated. Batch leaves are
    not listed: the ILP chooses their split (over the other mesh axis, data parallelism)."""
    specs = {}
    for path, ndim in leaves:
        if not path.startswith(_STATE_PREFIX):
            continue
        found = _BLOCK_LEAF.search(path)
        layer, kind = found.groups() if found else ("", "")
        if layer in COLUMN_PARALLEL:
            specs[path] = ShardingSpec.split(ndim, ndim - 1, (axis,))  # output features
        elif layer in ROW_PARALLEL and kind == "kernel":
            specs[path] = ShardingSpec.split(ndim, 0, (axis,))  # input features
        else:
            specs[path] = ShardingSpec.replicated(ndim)
    return specs


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
    plan.planning.method_options = {"method": "shard", "mesh_shape": list(mesh.shape)}
    plan.planning.baseline = "megatron"
    plan.planning.planning_time_s = time.perf_counter() - start
    return plan


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


@dataclass(frozen=True)
class PipelineSplits:
    """The DP's stages and the hand splits, with the stage count the splits used and why."""

    partitions: Mapping[str, StagePartition]  # "dp", "equal-layer", "equal-operator"
    num_stages: int
    note: str


def pipeline_splits(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                    cache: LayerCostCache, dp_stages: int, max_tries: int = 4) -> PipelineSplits:
    """Equal-layer and equal-operator stages as many as the DP chose (``dp_stages``); when the
    DP chose one stage, two (a one-stage "split" is the DP's own plan); when that count does
    not split the layers and devices evenly, the nearest count that does (more stages first).
    ``cache``: the layer costs the full search solved, reused."""
    from autopar.compiler.planners.pipeshard import stage_baselines

    wanted = max(2, dp_stages)
    counts = sorted(range(2, wanted + max_tries + 1), key=lambda c: (abs(c - wanted), -c))
    errors = []
    for count in counts[:max_tries]:
        try:
            found = stage_baselines(pp, method, cluster, cache=cache, num_stages=count)
        except PlanError as err:
            errors.append(str(err))
            continue
        if count == dp_stages:
            note = f"{count} stages, as the DP's"
        elif dp_stages == 1:
            note = f"{count} stages (the DP chose one stage: no pipeline)"
        else:
            note = f"{count} stages (the DP's {dp_stages} do not split evenly)"
        return PipelineSplits(found, count, note)
    raise PlanError(f"no stage count near {wanted} splits the layers and devices evenly: "
                    + (errors[-1] if errors else "no count tried"))
