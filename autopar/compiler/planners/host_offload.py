"""The full search's last resort for memory: a ShardParallel plan that keeps the optimizer
state in host memory between steps (``cost.host_state``), where nothing with it on the
devices fits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.host_state import host_state
from autopar.compiler.planners.step_program import PlannedProgram, StepProgram
from autopar.errors import CannotWinError, format_bytes
from autopar.method_options import RematMode
from autopar.methods import ShardParallel
from autopar.plan import Plan


def plan_offloaded(step: StepProgram, cluster: ClusterSpec,
                   on_device: Callable[[StepProgram], PlannedProgram],
                   fits: Callable[[Plan], bool], least_on_device: float) -> PlannedProgram | None:
    """``step``'s ``ShardParallel(remat="auto")`` planned again (by ``on_device``, the way it
    was planned with the state on the devices, where the least memory found was
    ``least_on_device``) with ``offload_optimizer_state``, where the cluster describes its
    devices' host link and the step has optimizer state; None where that does not apply or
    its plan does not ``fit`` either."""
    from autopar.compiler.intra_op.problem import InfeasibleMemoryError

    method = step.method
    if not (isinstance(method, ShardParallel) and method.remat == RematMode.AUTO
            and not method.offload_optimizer_state and cluster.device.host_link_bytes_per_s > 0):
        return None
    graph = step.traced.graph
    state = host_state(graph, step.batch_argnums)
    # a screen before any ILP: the moments and their new values, split over every device,
    # must at least cover what the least on-device plan is over by (at GPT-39B on 64 V100s
    # they are 5 GiB of a 29 GiB excess, and trying took 5 s of ILPs for nothing)
    moved = sum(graph.tensors[t].nbytes for t in state.inputs | state.outputs)
    budget = method.memory_budget_bytes or cluster.device.memory_bytes
    if not state or least_on_device - moved / cluster.num_devices > budget:
        return None
    offloaded = replace(step, method=replace(method, offload_optimizer_state=True))
    try:
        planned = on_device(offloaded)
    except (InfeasibleMemoryError, CannotWinError):
        return None
    if not fits(planned.plan):
        return None
    return planned.with_plan(planned.plan.noted(
        "remat='auto': no plan fitted with the optimizer state on the devices (the least "
        f"needed {format_bytes(least_on_device)} per device); kept in host memory between "
        f"steps, the plan needs {format_bytes(planned.plan.peak_memory_bytes)}"))
