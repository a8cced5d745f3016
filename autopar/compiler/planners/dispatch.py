"""The compiler's one entry point: a step + method + cluster -> Plan (pure, no devices).

Two calls, because the plan cache sits between them: :func:`trace` turns the step into what
the method plans (the flat program, and for pipelining the pipeline cut of it); :func:`plan`
plans it, with every method, the rematerialisation retry and the full search's fallback to one
stage. :func:`trace_for_plan` rebuilds the program a saved or cached plan's tensor ids refer
to. This module is the only place that dispatches on the method's type.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import ClusterSpec, format_mesh_shape
from autopar.compiler.cost.estimate import one_call_time_s
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import TracedStep, build_graph, trace_step
from autopar.compiler.inter_op.layers import remat_layer_positions
from autopar.compiler.inter_op.submesh import SubmeshShape
from autopar.compiler.planners.data import plan_data_parallel
from autopar.compiler.planners.stage_costs import logical_shapes
from autopar.compiler.planners.zero import optimizer_state_pins, plan_zero
from autopar.errors import (
    AutoparError,
    BatchSizeError,
    InvalidOptionError,
    MeshError,
    NoLossFunctionError,
    PlanError,
)
from autopar.ir.pipeline_program import PipelineProgram, build_pipeline_program
from autopar.methods import (
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

IlpObserver = Callable[[Any, Any], None]


@dataclass
class StepProgram:
    """A traced step as the compiler plans it.

    ``traced``: the program (and graph) the plan's tensor ids refer to; for a pipelined
    method the outer program, which holds the loss function as one equation. ``pipeline``:
    the pipeline cut (loss forward, pieces' inputs) when the method pipelines. ``fn`` and
    ``args``: the step itself, for tracing again with rematerialised layers. ``method``: what
    will plan it (the full search's one-stage fallback replaces a pipeline method that cannot
    pipeline this step). ``notes``: what the plan should say about how it was traced.
    """

    traced: TracedStep
    method: Method
    batch_argnums: tuple[int, ...]
    pipeline: PipelineProgram | None = None
    fn: Callable | None = None
    args: tuple[Any, ...] = ()
    notes: list[str] = field(default_factory=list)
    # the full search (AutoParallel): ``traced`` is the plain step (its one-stage candidates'
    # program), this the pipeline's outer program (its pipelined candidates')
    pipeline_traced: TracedStep | None = None

    @property
    def programs(self) -> tuple[Any, ...]:
        """The flat programs that identify the step (what a plan cache key hashes): for a
        pipeline also the microbatch forward, which tells two loss functions apart."""
        if self.pipeline is not None and self.pipeline_traced is None:
            return (self.pipeline.outer, self.pipeline.forward)
        if self.pipeline is not None:
            return (self.traced.program, self.pipeline.forward)
        return (self.traced.program,)

    def parts_for(self, plan: Plan) -> tuple[TracedStep, PipelineProgram | None]:
        """The traced program and pipeline cut that ``plan`` (made for this step) runs on."""
        if plan.is_pipelined:
            return (self.pipeline_traced or self.traced), self.pipeline
        return self.traced, None


@dataclass
class PlannedProgram:
    """A plan and the program its tensor ids refer to (traced again when rematerialised).
    ``candidates``: for the full search, every candidate's plan by name (the benchmark runs
    them as its baselines; not saved with the plan)."""

    traced: TracedStep
    plan: Plan
    pipeline: PipelineProgram | None = None
    candidates: dict[str, PlannedProgram] = field(default_factory=dict)


def trace(fn: Callable, args: Sequence[Any], method: Method, batch_argnums: Sequence[int], *,
          fall_back_to_shard: bool = False) -> StepProgram:
    """Trace ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``) for ``method``.

    ``fall_back_to_shard``: when ``method`` pipelines and the step cannot be pipelined (no
    ``autopar.value_and_grad``, or a batch the microbatches do not divide), plan one stage with
    the intra-operator pass instead, saying so in the plan's notes (the full search's
    behaviour); otherwise that is the error raised."""
    batch_argnums = tuple(batch_argnums)
    if isinstance(method, AutoParallel):
        return _trace_auto(fn, args, method, batch_argnums)
    if isinstance(method, PipeshardParallel):
        try:
            pp = build_pipeline_program(fn, args, batch_argnums, method.num_microbatches)
        except (NoLossFunctionError, BatchSizeError) as err:
            if not fall_back_to_shard:
                raise
            shard = ShardParallel(memory_budget_bytes=method.memory_budget_bytes,
                                  solver=method.solver, time_limit_s=method.time_limit_s)
            step = trace(fn, args, shard, batch_argnums)
            step.notes.append(f"one stage, no pipeline: {err}")
            return step
        return StepProgram(TracedStep(pp.outer, build_graph(pp.outer)), method, batch_argnums,
                           pipeline=pp, fn=fn, args=tuple(args))
    return StepProgram(trace_step(fn, args), method, batch_argnums, fn=fn, args=tuple(args))


def _trace_auto(fn: Callable, args: Sequence[Any], method: AutoParallel,
                batch_argnums: tuple[int, ...]) -> StepProgram:
    """The plain step (for the one-stage candidates) and, when pipelines are candidates and
    the step can be pipelined, its pipeline cut."""
    step = StepProgram(trace_step(fn, args), method, batch_argnums, fn=fn, args=tuple(args))
    if "pipeshard" not in method.candidates:
        return step
    try:
        pp = build_pipeline_program(fn, args, batch_argnums, method.num_microbatches)
    except (NoLossFunctionError, BatchSizeError) as err:
        step.notes.append(f"no pipelined candidate: {err}")
        return step
    step.pipeline = pp
    step.pipeline_traced = TracedStep(pp.outer, build_graph(pp.outer))
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
    traced = trace_step(fn, args, remat_positions=plan.remat_positions)
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
    if isinstance(method, AutoParallel):
        planned = _plan_auto(step, cluster, ilp_observer)
    elif isinstance(method, PipeshardParallel):
        planned = _plan_pipelined(step, method, step.traced, cluster)
    else:
        planned = _plan_one_stage_with_remat(step, cluster, ilp_observer)
    planned.plan.notes.extend(step.notes)
    return planned


def _plan_pipelined(step: StepProgram, method: PipeshardParallel, traced: TracedStep,
                    cluster: ClusterSpec) -> PlannedProgram:
    from autopar.compiler.planners.schedule_choice import plan_pipeline

    planned = PlannedProgram(traced, plan_pipeline(step.pipeline, method, cluster),
                             step.pipeline)
    planned.plan.batch_argnums = step.batch_argnums
    inexact = step.pipeline.inexact_draws
    if inexact:
        planned.plan.notes.append(
            "the loss function draws random numbers that each microbatch draws anew, so they "
            "differ from an unpipelined step's (same distribution): "
            + "; ".join(dict.fromkeys(inexact)))
    return planned


def _plan_auto(step: StepProgram, cluster: ClusterSpec,
               ilp_observer: IlpObserver | None) -> PlannedProgram:
    """The full search: every candidate method planned on the same cost model, the fastest
    plan fitting the memory budget kept. Its planning record lists every candidate (the
    pipelined ones each stage partition the stage search compared) with its estimate."""
    method = step.method
    assert isinstance(method, AutoParallel)
    start = time.perf_counter()
    budget = method.memory_budget_bytes or cluster.device.memory_bytes
    found: dict[str, PlannedProgram] = {}
    rows: list[dict[str, Any]] = []
    phases: dict[str, float] = {}
    for name, candidate in _one_stage_candidates(method, cluster):
        single = StepProgram(step.traced, candidate, step.batch_argnums, fn=step.fn,
                             args=step.args)
        began = time.perf_counter()
        try:
            planned = _plan_one_stage_with_remat(single, cluster, ilp_observer, budget)
        except AutoparError as err:
            rows.append(_failed_row(name, name, err))
            continue
        finally:
            phases[f"{name}_s"] = time.perf_counter() - began
        found[name] = planned
        rows.append(_candidate_row(name, planned.plan, budget))
    if step.pipeline is not None:
        pipelined = method.pipeline_method()
        began = time.perf_counter()
        try:
            found["pipeshard"] = _plan_pipelined(step, pipelined, step.pipeline_traced, cluster)
        except AutoparError as err:
            rows.append(_failed_row("pipeshard", "pipeshard", err))
        finally:
            phases["pipeshard_s"] = time.perf_counter() - began
        if "pipeshard" in found:
            planned = found["pipeshard"]
            phases.update(planned.plan.planning.phases)
            phases.pop("total_s", None)
            inner = planned.plan.planning.candidates
            search = planned.plan.planning.stage_search or {}
            if inner and search:
                inner[0]["ilp_statuses"] = dict(search.get("ilp_statuses", {}))
                inner[0]["ilp_solves"] = int(search.get("ilp_solves", 0))
            ilp_notes = [n for n in planned.plan.notes if "stage-cost ILPs" in n]
            for row in inner:
                row = dict(row, name=f"pipeshard: {row['name']}")
                if row.pop("chosen", False):
                    note = row.get("note", "")
                    row.update(_candidate_row(row["name"], planned.plan, budget))
                    row["note"] = "; ".join(n for n in (note, row["note"]) if n)
                rows.append(row)
    fitting = [(n, p) for n, p in found.items() if _fits_budget(p.plan, budget)]
    if not fitting:
        least = min(found.values(), key=lambda p: p.plan.peak_memory_bytes, default=None)
        if least is None:
            reasons = "; ".join(f"{r['name']}: {r['note']}" for r in rows)
            raise PlanError(f"the full search planned no candidate: {reasons}")
        raise PlanError(
            f"no candidate of the full search fits in {budget / 2**30:.2f} GiB per device: the "
            f"least memory is {least.plan.peak_memory_bytes / 2**30:.2f} GiB "
            f"({least.plan.method.value}); raise memory_budget_bytes, or use a larger cluster")
    name, best = min(fitting, key=lambda item: item[1].plan.est_step_time_s)
    plan = best.plan
    chosen_name = next((r["name"] for r in rows if r.get("chosen_plan") is plan), name)
    for row in rows:
        row["chosen"] = row.pop("chosen_plan", None) is plan
    ranked = sorted((r for r in rows if r.get("est_step_time_s") is not None and r["fits"]),
                    key=lambda r: r["est_step_time_s"])
    runner_up = next((r for r in ranked if not r["chosen"]), None)
    summary = (f"the full search compared {len(rows)} candidate plans and chose "
               f"{chosen_name} (est. {plan.est_step_time_s:.4g} s/step)")
    if runner_up is not None:
        summary += (f"; next: {runner_up['name']} (est. {runner_up['est_step_time_s']:.4g} s, "
                    f"{runner_up['est_step_time_s'] / plan.est_step_time_s:.2f}x)")
    plan.notes.insert(0, summary)
    if step.pipeline is not None and "pipeshard" in found and plan is not \
            found["pipeshard"].plan:
        plan.notes.extend(f"pipelined candidates: {n}" for n in ilp_notes)
    options = {"method": "auto", "chosen": plan.method.value,
               "candidates": list(method.candidates),
               "num_microbatches": method.num_microbatches, "schedule": method.schedule,
               "remat": method.remat}
    plan.planning.method_options = options | {"chosen_options": plan.planning.method_options}
    plan.planning.candidates = rows
    plan.planning.planning_time_s = time.perf_counter() - start
    plan.planning.phases = phases | {"total_s": plan.planning.planning_time_s}
    return PlannedProgram(best.traced, plan, best.pipeline, candidates=found)


def _one_stage_candidates(method: AutoParallel, cluster: ClusterSpec
                          ) -> list[tuple[str, Method]]:
    """The full search's one-stage candidates by name. ShardParallel runs on every logical
    mesh the stage search gives a stage over the whole cluster (``logical_shapes``): one axis,
    and a 2-D one (hosts x devices per host, or 2 x n/2 on one host), where the ILP can put
    the batch on one axis and the model on the other, as a data x tensor expert plan does."""
    found: list[tuple[str, Method]] = []
    whole = SubmeshShape(cluster.num_hosts, cluster.devices_per_host)
    for candidate in method.one_stage_methods():
        found.append((candidate.name.value, candidate))
        if isinstance(candidate, ShardParallel):
            for shape in logical_shapes(whole)[1:]:
                found.append((f"shard {format_mesh_shape(shape)}",
                              dataclasses.replace(candidate, mesh_shape=shape)))
    return found


def _fits_budget(plan: Plan, budget: float) -> bool:
    return plan.peak_memory_bytes <= budget


def _candidate_row(name: str, plan: Plan, budget: float) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": name, "method": plan.method.value, "est_step_time_s": plan.est_step_time_s,
        "peak_memory_bytes": plan.peak_memory_bytes,
        "fits": _fits_budget(plan, budget), "num_stages": len(plan.stages),
        "estimate": dict(plan.planning.estimate),
        "note": "rematerialised" if plan.remat_positions is not None else "",
        "chosen_plan": plan,
    }
    if not row["fits"]:
        row["note"] = (row["note"] + "; " if row["note"] else "") + (
            f"needs {plan.peak_memory_bytes / 2**30:.2f} GiB per device, over the budget")
    return row


def _failed_row(name: str, method: str, err: Exception) -> dict[str, Any]:
    return {"name": name, "method": method, "est_step_time_s": None, "fits": False,
            "note": " ".join(str(err).split())}


def _plan_one_stage_with_remat(step: StepProgram, cluster: ClusterSpec,
                               ilp_observer: IlpObserver | None,
                               budget: float | None = None) -> PlannedProgram:
    """``budget``: the memory that decides ``remat="auto"`` (default: the method's budget,
    else the device's memory)."""
    method = step.method
    remat = getattr(method, "remat", "none")
    planned = None
    if remat != "layers":
        planned = PlannedProgram(step.traced, _plan_one_stage(step.traced, method, cluster,
                                                              step.batch_argnums, ilp_observer))
    if remat != "none" and (planned is None
                            or not _fits(planned.plan, method, cluster, budget)):
        planned = _plan_rematerialised(step, cluster, planned, ilp_observer)
    return planned


def _fits(plan: Plan, method: Method, cluster: ClusterSpec, budget: float | None = None) -> bool:
    budget = budget or getattr(method, "memory_budget_bytes", None) or cluster.device.memory_bytes
    return plan.peak_memory_bytes <= budget


def _plan_rematerialised(step: StepProgram, cluster: ClusterSpec,
                         planned: PlannedProgram | None,
                         ilp_observer: IlpObserver | None) -> PlannedProgram:
    """Trace again with the loss function's layers under ``jax.checkpoint`` and plan that;
    for ``remat="auto"`` keep it only if it needs less memory than ``planned``."""
    if step.fn is None:
        raise InvalidOptionError("remat needs the step itself to trace it again; this step "
                                 "was given as a traced program only")
    try:
        pp = build_pipeline_program(step.fn, step.args, step.batch_argnums, 1)
    except NoLossFunctionError as err:
        if planned is None:
            raise InvalidOptionError(f"remat='layers' needs the step's gradient from "
                                     f"autopar.value_and_grad or autopar.grad: {err}") from None
        planned.plan.notes.append("remat='auto' left off: the step has no autopar.value_and_grad")
        return planned
    positions = remat_layer_positions(pp, build_graph(pp.forward))
    traced = trace_step(step.fn, step.args, remat_positions=positions)
    plan = _plan_one_stage(traced, step.method, cluster, step.batch_argnums, ilp_observer)
    if planned is not None and plan.peak_memory_bytes >= planned.plan.peak_memory_bytes:
        planned.plan.notes.append(
            "remat='auto' tried the layers under jax.checkpoint: no memory saved")
        return planned
    plan.remat_positions = tuple(positions)
    plan.notes.append(f"rematerialised: the loss function's {len(positions) + 1} layers run "
                      "under jax.checkpoint (the backward recomputes them)")
    return PlannedProgram(traced, plan)


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


def _plan_one_stage(
    traced: TracedStep,
    method: Method,
    cluster: ClusterSpec,
    batch_argnums: tuple[int, ...],
    ilp_observer: IlpObserver | None,
) -> Plan:
    """One stage over the whole cluster with ``method`` (data, shard, ZeRO); records the
    planning time and the method's options in the plan."""
    start = time.perf_counter()
    mesh = logical_mesh_for(cluster, method.mesh_shape)
    common = dict(batch_argnums=batch_argnums, cluster_name=cluster.name,
                  devices_per_host=cluster.devices_per_host)
    if isinstance(method, ShardParallel):
        # imported here: the ILP stack (PuLP, strategies) loads only when a plan needs it
        from autopar.compiler.intra_op.problem import InfeasibleMemoryError
        from autopar.compiler.intra_op.sharding_ilp import IntraOpOptions
        from autopar.compiler.planners.shard import plan_shard_parallel

        pins = (optimizer_state_pins(traced.graph, mesh, batch_argnums)
                if method.prefer_reduce_scatter else {})

        def solve_within(budget: float | None) -> Plan:
            options = IntraOpOptions(memory_budget_bytes=budget, solver=method.solver,
                                     time_limit_s=method.time_limit_s,
                                     batch_argnums=batch_argnums, pinned_inputs=pins)
            return plan_shard_parallel(traced, mesh, options, ilp_observer=ilp_observer,
                                       **common)

        # the memory rows make the ILP slower, so they are added only when the unconstrained
        # plan does not fit the budget (the device's memory unless one is given): the
        # unconstrained optimum, when it fits, is the constrained one
        plan = solve_within(None)
        budget = method.memory_budget_bytes
        limit = float(budget if budget is not None else cluster.device.memory_bytes)
        if plan.peak_memory_bytes > limit:
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
            plan.notes.append(f"the fastest plan did not fit {what}; solved again with it as "
                              "the per-device memory budget")
    elif isinstance(method, DataParallel):
        plan = plan_data_parallel(traced, mesh, **common)
    elif isinstance(method, Zero2Parallel | Zero3Parallel):
        plan = plan_zero(traced, mesh, stage=2 if isinstance(method, Zero2Parallel) else 3,
                         **common)
    else:
        raise InvalidOptionError(
            f"unknown method {type(method).__name__}; valid methods: DataParallel, "
            "ShardParallel, Zero2Parallel, Zero3Parallel, PipeshardParallel"
        )
    plan.planning.method_options = {"method": method.name.value,
                                    "mesh_shape": list(mesh.shape)}
    stage = plan.stages[0]
    runtime = one_call_time_s(cluster.runtime)
    plan.est_step_time_s = stage.est_time_s + runtime
    plan.planning.estimate = {"total_s": plan.est_step_time_s,
                              "compute_s": stage.est_compute_time_s,
                              "communication_s": stage.est_communication_time_s,
                              "runtime_s": runtime}
    plan.planning.planning_time_s = time.perf_counter() - start
    return plan


def plan_traced(traced: TracedStep, method: Method, cluster: ClusterSpec, *,
                batch_argnums: Sequence[int] = (1,)) -> Plan:
    """A one-stage plan of an already traced step (benchmarks' baselines, which trace once
    and plan several methods on it); same as :func:`plan` without rematerialisation."""
    if isinstance(method, PipeshardParallel):
        raise PlanError("plan_traced plans one stage; pipelined methods need the step: use "
                        "trace() and plan()")
    step = StepProgram(traced, method, tuple(batch_argnums))
    return plan(step, cluster).plan
