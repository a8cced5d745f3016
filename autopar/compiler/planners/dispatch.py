"""The compiler's one entry point: a step + method + cluster -> Plan (pure, no devices).

Two calls, because the plan cache sits between them: :func:`trace` turns the step into what
the method plans (the flat program, and for pipelining the pipeline cut of it); :func:`plan`
plans it, with every method, the rematerialisation retry and the full search's fallback to one
stage (the full search itself, its candidates: ``auto``). :func:`trace_for_plan` rebuilds the
program a saved or cached plan's tensor ids refer to. This module is the only place that
dispatches on the method's type; ShardParallel's one-stage plan within the memory budget is
``shard_budget``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.estimate import call_arrays, one_call_time_s
from autopar.compiler.cost.host_state import host_tensors
from autopar.compiler.cost.mesh import logical_mesh_for
from autopar.compiler.graph.attention_forms import trace_with_attention_kernel
from autopar.compiler.graph.trace import TracedStep, build_graph, trace_step
from autopar.compiler.planners.attention_kernel import plan_attention_kernel
from autopar.compiler.planners.auto import plan_auto, trace_auto
from autopar.compiler.planners.common import (
    PlanPlace,
    cut_into_microbatches,
    fewer_full_collections,
)
from autopar.compiler.planners.data import plan_data_parallel
from autopar.compiler.planners.host_offload import plan_offloaded
from autopar.compiler.planners.recompute_choice import (
    plan_recomputed_auto,
    plan_rematerialised,
)
from autopar.compiler.planners.shard_budget import check_can_win, plan_within_budget
from autopar.compiler.planners.step_program import (
    IlpObserver,
    PlannedProgram,
    StepProgram,
    TraceMemo,
)
from autopar.compiler.planners.zero import plan_zero
from autopar.errors import (
    BatchSizeError,
    InvalidOptionError,
    NoLossFunctionError,
    PlanError,
)
from autopar.ir.flatten import trace_jaxpr
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.method_options import RematMode
from autopar.methods import (
    METHOD_TYPES,
    AutoParallel,
    DataParallel,
    Method,
    PipeshardParallel,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)
from autopar.plan import Plan

# Primitives that draw random bits: a pipelined forward draws them per microbatch shape.
RANDOM_DRAWS = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


def trace(fn: Callable, args: Sequence[Any], method: Method, batch_argnums: Sequence[int], *,
          fall_back_to_shard: bool = False) -> StepProgram:
    """Trace ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``) for ``method``.

    ``fall_back_to_shard``: when ``method`` pipelines and the step cannot be pipelined (no
    ``autopar.value_and_grad``, or a batch the microbatches do not divide), plan one stage with
    the intra-operator pass instead, saying so in the plan's notes (the full search's
    behaviour); otherwise that is the error raised."""
    with fewer_full_collections():  # a large model's trace keeps as much alive as its plan
        return _trace(fn, args, method, tuple(batch_argnums), fall_back_to_shard)


def _trace(fn: Callable, args: Sequence[Any], method: Method, batch_argnums: tuple[int, ...],
           fall_back_to_shard: bool) -> StepProgram:
    if isinstance(method, AutoParallel):
        return trace_auto(fn, args, method, batch_argnums)
    jaxpr = trace_jaxpr(fn, args)
    if isinstance(method, PipeshardParallel):
        try:
            pp = cut_into_microbatches(fn, args, batch_argnums, method.num_microbatches,
                                        jaxpr=jaxpr,
                                        per_microbatch_statistics=method.per_microbatch_statistics)
        except (NoLossFunctionError, BatchSizeError) as err:
            if not fall_back_to_shard:
                raise
            shard = ShardParallel(memory_budget_bytes=method.memory_budget_bytes,
                                  solver=method.solver, time_limit_s=method.time_limit_s)
            step = StepProgram(trace_step(fn, args, jaxpr=jaxpr), shard, batch_argnums,
                               fn=fn, args=tuple(args))
            step.notes.append(f"one stage, no pipeline: {err}")
        else:
            step = StepProgram(TracedStep(pp.outer, build_graph(pp.outer)), method,
                               batch_argnums, pipeline=pp, fn=fn, args=tuple(args))
    else:
        step = StepProgram(trace_step(fn, args, jaxpr=jaxpr), method, batch_argnums, fn=fn,
                           args=tuple(args))
    step.memo.jaxpr = jaxpr
    return step


def trace_for_plan(fn: Callable, args: Sequence[Any], plan: Plan,
                   batch_argnums: Sequence[int]) -> StepProgram:
    """The program whose tensor ids ``plan`` names: the pipeline cut of the step for a
    pipelined plan, the step traced with the plan's rematerialised layers, or the plain step.
    The caller checks the plan against it (signature, spec ranks)."""
    batch_argnums = tuple(batch_argnums)
    if plan.is_pipelined:
        pp = build_pipeline_program(fn, args, batch_argnums, plan.num_microbatches)
        return StepProgram(TracedStep(pp.outer, build_graph(pp.outer)), PipeshardParallel(),
                           batch_argnums, pipeline=pp, fn=fn, args=tuple(args))
    traced = None
    if plan.attention_kernel:
        traced = trace_with_attention_kernel(fn, args)
        if traced is None:
            raise PlanError("the plan runs the step's attentions as autopar's kernel, but this "
                            "step has none it can run: it was made for another step")
    traced = traced or trace_step(fn, args, remat_positions=plan.remat_positions,
                                  remat_selective=plan.remat_selective)
    return StepProgram(traced, ShardParallel(), batch_argnums, fn=fn, args=tuple(args))


def plan(step: StepProgram, cluster: ClusterSpec, *,
         ilp_observer: IlpObserver | None = None) -> PlannedProgram:
    """Plan ``step`` with ``step.method`` on ``cluster``.

    One-stage methods with ``remat="layers"`` are planned on the step traced again with each
    layer of its loss forward under ``jax.checkpoint``; with ``remat="auto"`` that is tried when
    the plan without it does not fit the memory budget. ``ilp_observer(problem, solution)`` is
    called with each one-stage sharding ILP solved (``autopar compile --dump-ilp``).
    """
    method = step.method
    with fewer_full_collections():
        if isinstance(method, AutoParallel):
            planned = plan_auto(step, cluster, ilp_observer,
                                plan_one_stage=_plan_one_stage_with_remat,
                                plan_pipelined=_plan_pipelined)
        elif isinstance(method, PipeshardParallel):
            planned = _plan_pipelined(step, method, step.traced, cluster)
        else:
            planned = _plan_one_stage_with_remat(step, cluster, ilp_observer)
    dropped = planned.traced.program.dropped_constraints
    notes = list(step.notes)
    if dropped and not planned.plan.is_pipelined:
        notes.insert(0,
            f"the step's {dropped} with_sharding_constraint call(s) run as plain copies: the "
            "plan sets every layout (kept, XLA resharded around the ones it did not choose)")
    return planned.with_plan(planned.plan.noted(*notes)) if notes else planned


def _plan_pipelined(step: StepProgram, method: PipeshardParallel, traced: TracedStep,
                    cluster: ClusterSpec, *,
                    meanwhile: Callable[[], Any] | None = None) -> PlannedProgram:
    """``meanwhile()``: this process's own work, done while the stage search's first forked
    layer ILPs run (``LayerCostCache.meanwhile``; left undone if none are forked: the caller
    does it then)."""
    from autopar.compiler.inter_op.step_parts import step_work
    from autopar.compiler.planners.schedule_choice import plan_pipeline
    from autopar.compiler.planners.stage_costs import layer_cost_cache

    pipeline = step.pipeline
    assert pipeline is not None, "a pipelined method's step is traced with its pipeline cut"
    step.status.enter("pipelines")
    cache = layer_cost_cache(method)
    if traced.program is pipeline.outer:  # its graph is built: not again for the step's work
        cache.work = step_work(pipeline, traced.graph)
    cache.status = step.status
    cache.meanwhile = meanwhile
    plan = replace(plan_pipeline(pipeline, method, cluster, cache=cache),
                   batch_argnums=step.batch_argnums)
    dropped = pipeline.dropped_constraints
    if dropped:
        plan = plan.noted(
            f"the loss function's {dropped} with_sharding_constraint call(s) are left out of "
            "the pipeline: each stage runs on its own submesh, in the plan's layouts")
    inexact = pipeline.inexact_draws
    if inexact:
        plan = plan.noted(
            "the loss function draws random numbers that each microbatch draws anew, so they "
            "differ from an unpipelined step's (same distribution): "
            + "; ".join(dict.fromkeys(inexact)))
    return PlannedProgram(traced, plan, pipeline)


def _plan_one_stage_with_remat(step: StepProgram, cluster: ClusterSpec,
                               ilp_observer: IlpObserver | None,
                               budget: float | None = None,
                               beat: float | None = None) -> PlannedProgram:
    """``budget``: the memory that decides ``remat="auto"`` (default: the method's budget,
    else the device's memory). ``beat``: the estimate of a plan that fits, found already
    (the full search's): where the fastest plan does not fit and is estimated no faster,
    ``CannotWinError`` rather than the memory-constrained solve or the recomputation.
    With ``remat="auto"``, where neither the plain step nor its recomputed layers fit, the
    step with its attentions run by autopar's kernel is planned too (``attention_kernel``),
    and where none of that fits, a ShardParallel plan keeping the optimizer state in host
    memory between steps (``host_offload``).
    """
    from autopar.compiler.intra_op.problem import InfeasibleMemoryError

    def on_device(step: StepProgram) -> PlannedProgram:
        return _plan_on_device(step, cluster, ilp_observer, budget, beat)

    def fits(plan: Plan) -> bool:
        return _fits(plan, step.method, cluster, budget)

    try:
        planned = on_device(step)
    except InfeasibleMemoryError as err:
        offloaded = plan_offloaded(step, cluster, on_device, fits, err.min_peak_bytes)
        if offloaded is None:
            raise
        return offloaded
    return planned if fits(planned.plan) else (plan_offloaded(
        step, cluster, on_device, fits, planned.plan.peak_memory_bytes) or planned)


def _plan_on_device(step: StepProgram, cluster: ClusterSpec, ilp_observer: IlpObserver | None,
                    budget: float | None, beat: float | None) -> PlannedProgram:
    """``_plan_one_stage_with_remat`` without the optimizer state off the devices."""
    from autopar.compiler.intra_op.problem import InfeasibleMemoryError

    try:
        planned = _plan_recomputing(step, cluster, ilp_observer, budget, beat)
    except InfeasibleMemoryError as err:
        # the kernel saves activations only: not tried where the state alone is over
        kernel = None if _state_over_budget(step, cluster, err.budget) else \
            plan_attention_kernel(step, cluster, _plan_one_stage, ilp_observer, beat, err)
        if kernel is None:
            raise
        return kernel
    if _fits(planned.plan, step.method, cluster, budget) or _beyond_recompute(
            planned.plan, step.method, cluster, budget):
        return planned
    return plan_attention_kernel(step, cluster, _plan_one_stage, ilp_observer, beat,
                                 planned) or planned


def _plan_recomputing(step: StepProgram, cluster: ClusterSpec,
                      ilp_observer: IlpObserver | None, budget: float | None,
                      beat: float | None) -> PlannedProgram:
    """The plain step's plan, or its layers recomputed (``remat``): see
    ``_plan_one_stage_with_remat``."""
    from autopar.compiler.intra_op.problem import InfeasibleMemoryError

    method = step.method
    remat = getattr(method, "remat", RematMode.NONE)
    planned = None

    def fits(plan: Plan) -> bool:
        return _fits(plan, method, cluster, budget)

    if remat not in (RematMode.LAYERS, RematMode.SELECTIVE):
        try:
            planned = PlannedProgram(step.traced, _plan_one_stage(
                step.traced, method, cluster, step.batch_argnums, ilp_observer, step.memo,
                beat))
        except InfeasibleMemoryError as err:
            if remat == RematMode.NONE or step.fn is None or _state_over_budget(
                    step, cluster, err.budget):
                raise
            # "auto": no plan without recomputation fits, which is what it is for
            try:
                return plan_recomputed_auto(step, cluster, None, ilp_observer,
                                            _plan_one_stage, fits, beat)
            except InvalidOptionError:  # no layers to recompute: the memory is the answer
                pass
            raise
    if remat != RematMode.NONE and (planned is None
                            or not _fits(planned.plan, method, cluster, budget)):
        if planned is not None and _beyond_recompute(planned.plan, method, cluster, budget):
            return planned.with_plan(planned.plan.noted(
                "remat='auto' left off: the state alone does not fit, and recomputing layers "
                "saves activations only"))
        if planned is not None:
            check_can_win(planned.plan, beat)
        if planned is None:  # remat="layers" or "selective": the user's choice
            planned = plan_rematerialised(step, cluster, None, ilp_observer, _plan_one_stage,
                                          beat)
        else:
            planned = plan_recomputed_auto(step, cluster, planned, ilp_observer,
                                           _plan_one_stage, fits, beat)
    assert planned is not None, "planned above unless remat='layers', which plans just above"
    return planned


def _state_over_budget(step: StepProgram, cluster: ClusterSpec, budget: float) -> bool:
    """Whether the step's state, inputs and updated state alone, split as far as the method's
    mesh splits them, exceed ``budget``: recomputing layers saves activations only, so it
    cannot fit either (and is not traced)."""
    host = host_tensors(step.traced.graph, step.batch_argnums,
                        getattr(step.method, "offload_optimizer_state", False))
    floor = step.memo.memory_floor(step.traced, step.batch_argnums, cluster.num_devices, host)
    if floor.total - floor.activations > budget:
        return True
    mesh = logical_mesh_for(cluster, getattr(step.method, "mesh_shape", None))
    floor = step.memo.mesh_memory_floor(step.traced, step.batch_argnums, tuple(mesh.shape),
                                        host)
    return floor.total - floor.activations > budget


def _beyond_recompute(plan: Plan, method: Method, cluster: ClusterSpec,
                      budget: float | None) -> bool:
    """Whether ``plan``'s memory other than activations is already over the budget."""
    budget = budget or getattr(method, "memory_budget_bytes", None) or cluster.device.memory_bytes
    parts = plan.stages[0].memory_breakdown
    return sum(parts.values()) - parts.get("activations", 0) > budget


def _fits(plan: Plan, method: Method, cluster: ClusterSpec, budget: float | None = None) -> bool:
    budget = budget or getattr(method, "memory_budget_bytes", None) or cluster.device.memory_bytes
    return plan.peak_memory_bytes <= budget


def _plan_one_stage(
    traced: TracedStep,
    method: Method,
    cluster: ClusterSpec,
    batch_argnums: tuple[int, ...],
    ilp_observer: IlpObserver | None,
    memo: TraceMemo | None = None,
    beat: float | None = None,
) -> Plan:
    """One stage over the whole cluster with ``method`` (data, shard, ZeRO); records the
    planning time and the method's options in the plan. ``memo``: the step's shared traces,
    memory floors and sharding problems. ``beat``: see ``_plan_one_stage_with_remat``."""
    start = time.perf_counter()
    if not isinstance(method, ShardParallel | DataParallel | Zero2Parallel | Zero3Parallel):
        raise InvalidOptionError(
            f"unknown method {type(method).__name__}; valid methods: "
            + ", ".join(t.__name__ for t in METHOD_TYPES if t is not AutoParallel))
    mesh = logical_mesh_for(cluster, method.mesh_shape)
    common = PlanPlace(batch_argnums=batch_argnums, cluster_name=cluster.name,
                       devices_per_host=cluster.devices_per_host)
    memo = memo or TraceMemo()
    if isinstance(method, ShardParallel):
        plan = plan_within_budget(traced, method, cluster, mesh, common, ilp_observer, memo, beat)
    else:
        # planned once per step and mesh: the full search comes back to one that did not fit
        data_key = (id(traced.graph), cluster, type(method).__name__, tuple(mesh.shape))
        if data_key not in memo.fastest:
            memo.fastest[data_key] = (
                plan_data_parallel(traced, mesh, **common) if isinstance(method, DataParallel)
                else plan_zero(traced, mesh, stage=2 if isinstance(method, Zero2Parallel)
                               else 3, **common))
        plan = memo.fastest[data_key]
    stage = plan.stages[0]
    runtime = one_call_time_s(cluster.runtime, call_arrays(traced.graph, batch_argnums),
                              min(mesh.num_devices, cluster.devices_per_host))
    total = stage.est_time_s + runtime
    return replace(plan, est_step_time_s=total).with_planning(
        method_options={"method": method.name.value, "mesh_shape": list(mesh.shape)},
        estimate={"total_s": total, "compute_s": stage.est_compute_time_s,
                  "communication_s": stage.est_communication_time_s, "runtime_s": runtime},
        planning_time_s=time.perf_counter() - start)


def plan_traced(traced: TracedStep, method: Method, cluster: ClusterSpec, *,
                batch_argnums: Sequence[int] = (1,)) -> Plan:
    """A one-stage plan of an already traced step (benchmarks' baselines, which trace once
    and plan several methods on it); same as :func:`plan` without rematerialisation."""
    if isinstance(method, PipeshardParallel):
        raise PlanError("plan_traced plans one stage; pipelined methods need the step: use "
                        "trace() and plan()")
    step = StepProgram(traced, method, tuple(batch_argnums))
    return plan(step, cluster).plan
