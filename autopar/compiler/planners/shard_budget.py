"""ShardParallel's one-stage plan within the memory budget (``dispatch`` plans every
one-stage method; this is the ShardParallel branch of it).

The memory floors are checked before an ILP is built, the user's pinned inputs are checked
against the step and the mesh, the fastest plan is solved (once per step and mesh, kept in the
step's memo) and, where it is over the budget, solved again under it, unless a plan that fits
is already known to be no slower (``check_can_win``: ``CannotWinError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.estimate import call_arrays, one_call_time_s
from autopar.compiler.cost.host_state import host_tensors
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import TracedStep
from autopar.compiler.planners.common import PlanPlace
from autopar.compiler.planners.step_program import IlpObserver, TraceMemo
from autopar.compiler.planners.zero import optimizer_state_pins
from autopar.errors import CannotWinError, InvalidOptionError
from autopar.methods import ShardParallel
from autopar.plan import Plan


def check_can_win(fastest: Plan, beat: float | None, estimate_s: float | None = None) -> None:
    """``CannotWinError`` when ``fastest``, a plan over the memory budget, is estimated
    (``estimate_s``, default its own) no faster than ``beat``: a plan that fits, solved under
    the budget or with recomputation (the step plus its recomputed forward), is no faster
    than the fastest."""
    estimate_s = fastest.est_step_time_s if estimate_s is None else estimate_s
    if beat is not None and estimate_s >= beat:
        raise CannotWinError(
            f"not solved under the memory budget: its fastest plan needs "
            f"{fastest.peak_memory_bytes / 2**30:.2f} GiB and is estimated at "
            f"{estimate_s:.4g} s, no faster than a plan that fits ({beat:.4g} s)",
            estimate_s, fastest.peak_memory_bytes)


def _checked_pins(pinned: Sequence[tuple[str, Any]], traced: TracedStep,
                  mesh: LogicalMesh) -> dict[str, Any]:
    """``ShardParallel.pinned_inputs`` as a dict, each path an input of the step and each spec
    of its rank over the mesh's axes (InvalidOptionError, one line, otherwise)."""
    ranks = {io.path: len(traced.graph.tensors[io.tensor].shape) for io in traced.graph.inputs}
    for path, spec in pinned:
        if path not in ranks:
            shown = ", ".join(list(ranks)[:4])
            raise InvalidOptionError(f"pinned input {path!r} is not an input leaf of the step; "
                                     f"its leaves are named like {shown}")
        axes = {a for dim in spec.dims for a in dim}
        if spec.ndim != ranks[path] or not axes <= set(mesh.axis_names):
            raise InvalidOptionError(
                f"pinned spec of {path!r} must have {ranks[path]} dims over the mesh axes "
                f"{', '.join(mesh.axis_names)}; got {spec.dims}")
    return dict(pinned)


def _pins(traced: TracedStep, method: ShardParallel, mesh: LogicalMesh,
          batch_argnums: tuple[int, ...]) -> dict[str, Any]:
    """The inputs whose layouts the ILP takes as given: the optimizer state sharded where
    the method prefers reduce-scatters, and the user's pinned inputs."""
    pins = (optimizer_state_pins(traced.graph, mesh, batch_argnums)
            if method.prefer_reduce_scatter else {})
    pins.update(_checked_pins(method.pinned_inputs, traced, mesh))
    return pins


def _check_floors(traced: TracedStep, batch_argnums: tuple[int, ...], mesh: LogicalMesh,
                  memo: TraceMemo, limit: float, offload: bool = False) -> None:
    """No plan holds less of a tensor than the most its shape can be split on the mesh: a
    step whose floor is over ``limit`` is answered (``InfeasibleMemoryError``) before its ILP
    is built (at published sizes the build, and the memory-constrained solve after it, take
    minutes; GPT 529.6B on a 315 x 8 mesh splits its parameters 8 ways at most)."""
    from autopar.compiler.intra_op.problem import InfeasibleMemoryError

    # with the optimizer state in host memory (``offload``), it is not on the devices
    host = host_tensors(traced.graph, batch_argnums, offload)
    devices = len(mesh.device_ids)
    floor = memo.memory_floor(traced, batch_argnums, devices, host)
    if floor.total > limit:
        raise InfeasibleMemoryError(limit, floor.total, floor.dominant(), split_over=devices)
    floor = memo.mesh_memory_floor(traced, batch_argnums, tuple(mesh.shape), host)
    if floor.total > limit:
        raise InfeasibleMemoryError(limit, floor.total, floor.dominant(), split_over=devices,
                                    mesh_shape=tuple(mesh.shape))


def plan_within_budget(traced: TracedStep, method: ShardParallel, cluster: ClusterSpec,
                       mesh: LogicalMesh, common: PlanPlace, ilp_observer: IlpObserver | None,
                       memo: TraceMemo, beat: float | None) -> Plan:
    """ShardParallel's one-stage plan: the fastest (kept in ``memo``), solved again under the
    budget where it is over it (``beat``: see ``dispatch._plan_one_stage_with_remat``)."""
    batch_argnums = common["batch_argnums"]
    # imported here: the ILP stack (PuLP, strategies) loads only when a plan needs it
    from autopar.compiler.intra_op.problem import InfeasibleMemoryError
    from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions, MeshCaches
    from autopar.compiler.planners.shard import plan_shard_parallel

    budget = method.memory_budget_bytes
    limit = float(budget if budget is not None else cluster.device.memory_bytes)
    _check_floors(traced, batch_argnums, mesh, memo, limit, method.offload_optimizer_state)
    pins = _pins(traced, method, mesh, batch_argnums)
    # what the fastest plan and its problem depend on (not the budget, nor the time limit
    # the full search cuts as its time budget runs out)
    key = (id(traced.graph), cluster, tuple(mesh.shape), method.solver,
           method.prefer_reduce_scatter, method.pinned_inputs, method.offload_optimizer_state)
    # the problem built for the fastest plan is solved again under the budget, not built
    # again (at GPT-3 175B on 1,024 devices a build is about 10 s), also when the full
    # search comes back to it (``beat``)
    built = memo.problems.setdefault(key, {})
    caches = memo.mesh_caches.setdefault((id(traced.graph), cluster, tuple(mesh.shape)),
                                         MeshCaches())

    def solve_within(budget: float | None) -> Plan:
        options = IntraOpOptions(memory_budget_bytes=budget, solver=method.solver,
                                 time_limit_s=method.time_limit_s,
                                 batch_argnums=batch_argnums, pinned_inputs=pins,
                                 offload_optimizer_state=method.offload_optimizer_state)
        return plan_shard_parallel(traced, mesh, options, ilp_observer=ilp_observer,
                                   built=built, caches=caches, **common)

    # the memory rows make the ILP slower, so they are added only when the unconstrained
    # plan does not fit the budget (the device's memory unless one is given): the
    # unconstrained optimum, when it fits, is the constrained one
    if key not in memo.fastest:
        memo.fastest[key] = solve_within(None)
    plan = memo.fastest[key]
    if plan.peak_memory_bytes > limit:
        # its estimate as the step's (below: the runtime's call added)
        call_s = one_call_time_s(cluster.runtime, call_arrays(traced.graph, batch_argnums),
                                 min(mesh.num_devices, cluster.devices_per_host))
        check_can_win(plan, beat, plan.stages[0].est_time_s + call_s)
        fastest = plan
        try:
            plan = solve_within(limit)
        except InfeasibleMemoryError as err:
            # the least memory known: the least-memory plan's or the fastest plan's
            if fastest.peak_memory_bytes < err.min_peak_bytes:
                raise InfeasibleMemoryError(err.budget, fastest.peak_memory_bytes,
                                            err.dominant) from None
            raise
        what = ("the memory budget" if budget is not None
                else f"the device's {limit / 2**30:.1f} GiB")
        plan = plan.noted(f"the fastest plan did not fit {what}; solved again with it as "
                          "the per-device memory budget")
    return plan
