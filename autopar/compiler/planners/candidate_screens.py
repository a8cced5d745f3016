"""What the full search (``full_search``) knows about its candidates before and after planning
them: the one-stage candidates by name, the state and memory floors that refuse a candidate
without an ILP, the ILP limit a time budget leaves, whether a one-stage plan leaves the
pipelines nothing to win, and whether a pipeline is one stage cut into microbatches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, TypeVar

from autopar.cluster import ClusterSpec, format_mesh_shape
from autopar.compiler.cost.memory_model import parameter_inputs
from autopar.compiler.inter_op.submesh import SubmeshShape
from autopar.compiler.planners.annotations import UserLayout
from autopar.compiler.planners.candidate_rows import fits_budget
from autopar.compiler.planners.pipeline_search import driver_floor_s
from autopar.compiler.planners.stage_costs import logical_shapes
from autopar.compiler.planners.step_program import PlannedProgram, StepProgram
from autopar.ir.pipeline_program import PipelineProgram
from autopar.method_options import RematMode
from autopar.methods import (
    AutoParallel,
    DataParallel,
    Method,
    OneStageMethod,
    PipeshardParallel,
    ShardParallel,
    Zero2Parallel,
)
from autopar.plan import MethodName, Plan

M = TypeVar("M", bound=Method)


def one_stage_candidates(
        method: AutoParallel, cluster: ClusterSpec,
        annotations: UserLayout | None = None) -> list[tuple[str, OneStageMethod]]:
    """The full search's one-stage candidates by name. ShardParallel runs on every 2-D
    logical mesh the stage search gives a stage over the whole cluster (``logical_shapes``),
    where the ILP can put the batch on one axis and the model on the other, as a data x
    tensor expert plan does; on one axis (its default) too on one host, not over several,
    where every collective on that axis is priced at the links between hosts and a 2-D mesh
    can lay out all it can (``logical_shapes``; at GPT-3 175B on 1,024 A100s that
    whole-model ILP took 38 s of a 188 s search)."""
    found: list[tuple[str, OneStageMethod]] = []
    whole = SubmeshShape(cluster.num_hosts, cluster.devices_per_host)
    two_axes = [s for s in logical_shapes(whole) if len(s) == 2]
    for candidate in method.one_stage_methods():
        if not isinstance(candidate, ShardParallel) or cluster.num_hosts == 1 or not two_axes:
            found.append((candidate.name.value, candidate))
        if isinstance(candidate, ShardParallel):
            for shape in two_axes:
                found.append((f"shard {format_mesh_shape(shape)}",
                              dataclasses.replace(candidate, mesh_shape=shape)))
            # the user's own layout: their mesh's shape, their committed inputs pinned
            if annotations is not None and \
                    math.prod(annotations.mesh_shape) == cluster.num_devices:
                found.append((annotations.label, dataclasses.replace(
                    candidate, mesh_shape=annotations.mesh_shape,
                    pinned_inputs=annotations.pins)))
    return found


def replicated_state_bytes(step: StepProgram, method: Method) -> float:
    """Bytes of the step's state ``method`` keeps whole on every device: data parallelism
    its parameters and optimizer state, ZeRO-2 its parameters (0 for the methods that may
    split them). No plan of the method holds less, so one over the budget is not planned:
    at Megatron's 1T row, estimating such a plan took 28 s of a 178 s search."""
    if not isinstance(method, DataParallel | Zero2Parallel):
        return 0.0
    graph = step.traced.graph
    batch = set(step.batch_argnums)
    kept = parameter_inputs(graph, batch) if isinstance(method, Zero2Parallel) else {
        io.tensor for io in graph.inputs if io.arg_index not in batch}
    return float(sum(graph.tensors[t].nbytes for t in kept))


def floor_without_recompute(step: StepProgram, method: Method, cluster: ClusterSpec) -> float:
    """The least bytes per device any plan of ``method`` needs when it does not recompute
    (ZeRO, data parallelism with ``remat="none"``): the step's memory floor with every tensor
    split over all the devices (``memory_floor``; no layout holds less). 0 for ShardParallel,
    which checks it itself, and for methods that may recompute to save activations. At
    Megatron's 1T row, estimating a ZeRO-3 plan that needs 11,278 GiB took 5 s; the floor
    (884 GiB) was known."""
    if isinstance(method, ShardParallel) or getattr(method, "remat",
                                                    RematMode.NONE) != RematMode.NONE:
        return 0.0
    return step.memo.memory_floor(step.traced, step.batch_argnums, cluster.num_devices).total


def within_deadline(method: M, deadline: float | None) -> M:
    """``method`` with its ILP time limit cut to the seconds left before ``deadline``."""
    if deadline is None or not isinstance(method, ShardParallel | PipeshardParallel | AutoParallel):
        return method
    left = max(deadline - time.perf_counter(), 0.05)
    return dataclasses.replace(method, time_limit_s=min(method.time_limit_s, left))


def pipelines_cannot_win(found: dict[str, PlannedProgram], budget: float, method: AutoParallel,
                         cluster: ClusterSpec, rows: list[dict[str, Any]],
                         pp: PipelineProgram) -> bool:
    """Whether a one-stage plan fitting the budget is estimated at or below the least driver
    time of any pipeline of two or more stages of ``pp`` (``driver_floor_s``), so that no
    pipeline can be chosen (a one-stage pipeline is kept only for memory); if so, says why in
    ``rows``."""
    fitting = [p.plan.est_step_time_s for p in found.values() if fits_budget(p.plan, budget)]
    floor = driver_floor_s(pp, method.pipeline_method(), cluster)
    if not fitting or min(fitting) > floor:
        return False
    rows.append({"name": MethodName.PIPESHARD, "method": MethodName.PIPESHARD,
                 "est_step_time_s": None,
                 "fits": False, "note": (
                     f"not planned: any pipeline of two or more stages costs at least "
                     f"{floor * 1e3:.3g} ms a step in its driver's tasks and transfers on this "
                     f"cluster, and a one-stage plan that fits is estimated at "
                     f"{min(fitting) * 1e3:.3g} ms "
                     "(AutoParallel(prune=False) plans it anyway)")})
    return True


def cut_one_stage(plan: Plan) -> bool:
    """Whether ``plan`` is one stage whose step is cut into several microbatches (per
    replica, where the pipeline is replicated)."""
    replicas = plan.pipeline.replicas if plan.pipeline is not None else 1
    return len(plan.stages) == 1 and plan.num_microbatches // replicas > 1
