"""The full search (``AutoParallel``): its tracing (the plain step, and the pipeline cut when
pipelines are candidates) and its planning: every one-stage candidate (each method, ShardParallel
also on a 2-D mesh) and the pipelined one planned on the same cost model, the fastest plan
fitting the memory budget kept, with a planning record of every candidate.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from autopar.cluster import ClusterSpec, format_mesh_shape
from autopar.compiler.cost.memory_model import parameter_inputs
from autopar.compiler.graph.trace import TracedStep, build_graph, trace_step
from autopar.compiler.inter_op.submesh import SubmeshShape
from autopar.compiler.planners import one_stage_beside
from autopar.compiler.planners.annotations import UserLayout, user_layout
from autopar.compiler.planners.candidate_rows import (
    annotations_note,
    candidate_row,
    failed_row,
    fits_budget,
    no_candidate_text,
)
from autopar.compiler.planners.common import cut_into_microbatches
from autopar.compiler.planners.pipeline_search import driver_floor_s
from autopar.compiler.planners.stage_costs import logical_shapes
from autopar.compiler.planners.step_program import IlpObserver, PlannedProgram, StepProgram
from autopar.errors import (
    AutoparError,
    BatchSizeError,
    CannotWinError,
    NoLossFunctionError,
    PlanError,
)
from autopar.ir.flatten import trace_jaxpr
from autopar.methods import (
    AutoParallel,
    DataParallel,
    Method,
    OneStageMethod,
    PipeshardParallel,
    ShardParallel,
    Zero2Parallel,
)
from autopar.plan import Plan

OneStagePlanner = Callable[[StepProgram, ClusterSpec, IlpObserver | None, float,
                            float | None], PlannedProgram]
# ``beat`` for a one-stage candidate's first planning: no plan fits yet, so one whose fastest
# plan is over the budget is put off (``CannotWinError``) until the pipelines are planned
DEFER = 0.0
PipelinePlanner = Callable[[StepProgram, PipeshardParallel, TracedStep, ClusterSpec],
                           PlannedProgram]
M = TypeVar("M", bound=Method)


def trace_auto(fn: Callable, args: Sequence[Any], method: AutoParallel,
               batch_argnums: tuple[int, ...]) -> StepProgram:
    """The plain step (for the one-stage candidates) and, when pipelines are candidates and
    the step can be pipelined, its pipeline cut."""
    jaxpr = trace_jaxpr(fn, args)
    step = StepProgram(trace_step(fn, args, jaxpr=jaxpr), method, batch_argnums, fn=fn,
                       args=tuple(args))
    step.memo.jaxpr = jaxpr
    step.annotations = user_layout(args, jaxpr.in_paths)
    if "pipeshard" not in method.candidates:
        return step
    try:
        pp = cut_into_microbatches(fn, args, batch_argnums, method.num_microbatches,
                                    jaxpr=jaxpr,
                                    per_microbatch_statistics=method.per_microbatch_statistics)
    except (NoLossFunctionError, BatchSizeError) as err:
        step.notes.append(f"no pipelined candidate: {err}")
        return step
    step.pipeline = pp
    step.pipeline_traced = TracedStep(pp.outer, build_graph(pp.outer))
    return step


def plan_auto(step: StepProgram, cluster: ClusterSpec, ilp_observer: IlpObserver | None, *,
              plan_one_stage: OneStagePlanner, plan_pipelined: PipelinePlanner) -> PlannedProgram:
    """The full search: every candidate method planned on the same cost model, the fastest
    plan fitting the memory budget kept. Its planning record lists every candidate (the
    pipelined ones each stage partition the stage search compared) with its estimate.

    ``plan_one_stage(step, cluster, ilp_observer, budget, beat)`` and ``plan_pipelined(step,
    method, traced, cluster)`` plan one candidate: passed in rather than imported, since they are
    ``dispatch``'s, the one place that dispatches on the method's type, which imports this
    module."""
    method = step.method
    assert isinstance(method, AutoParallel)
    start = time.perf_counter()
    budget = method.memory_budget_bytes or cluster.device.memory_bytes
    found: dict[str, PlannedProgram] = {}
    rows: list[dict[str, Any]] = []
    phases: dict[str, float] = {}
    deadline = None if method.time_budget_s is None else start + method.time_budget_s
    skipped: list[str] = []

    def within_budget(name: str) -> bool:
        # until one candidate has a plan the search goes on: a plan is what it is for
        if deadline is None or time.perf_counter() < deadline or not found:
            return True
        skipped.append(name)
        rows.append(skipped_row(name))
        return False

    def skipped_row(name: str) -> dict[str, Any]:
        return {"name": name, "method": name.split(" ")[0], "est_step_time_s": None,
                "fits": False,
                "note": f"skipped: the time budget ({method.time_budget_s:g} s) was spent"}

    # one-stage candidates whose fastest plan is over the budget, by their row: solved under
    # the budget (or rematerialised) only once the pipelines are planned, and only where that
    # fastest plan is estimated faster than every plan that fits (``CannotWinError``): at
    # published sizes those solves took most of the search (GPT 76.1B on 1,024 GPUs: 77 s)
    deferred: list[tuple[str, OneStageMethod, int]] = []

    def plan_single(name: str, candidate: OneStageMethod,
                    beat: float | None) -> dict[str, Any] | None:
        step.status.enter(name)
        single = StepProgram(step.traced, candidate, step.batch_argnums, fn=step.fn,
                             args=step.args, memo=step.memo)
        began = time.perf_counter()
        deferring = False
        try:
            planned = plan_one_stage(single, cluster, ilp_observer, budget, beat)
        except CannotWinError as err:
            deferring = beat == DEFER
            return None if deferring else failed_row(name, name, err)
        except AutoparError as err:
            return failed_row(name, name, err)
        finally:
            phases[f"{name}_s"] = phases.get(f"{name}_s", 0.0) + time.perf_counter() - began
            if isinstance(candidate, ShardParallel) and not deferring:  # its ILP, counted once
                step.status.solved()
        found[name] = planned
        return candidate_row(name, planned.plan, budget)

    beside = one_stage_beside.plans_beside(step, method, cluster, ilp_observer, deadline)
    singles: list[tuple[str, OneStageMethod, int]] = []  # planned beside the pipelines, by row
    for name, candidate in _one_stage_candidates(method, cluster, step.annotations):
        if not within_budget(name):
            continue
        replicated = _replicated_state_bytes(step, candidate)
        floor = _floor_without_recompute(step, candidate, cluster)
        if replicated > budget or floor > budget:
            rows.append({"name": name, "method": name.split(" ")[0], "est_step_time_s": None,
                         "fits": False, "needs_bytes": max(replicated, floor), "note": (
                             f"not planned: the state it keeps whole on every device needs "
                             f"{replicated / 2**30:.2f} GiB, over the budget"
                             if replicated > budget else
                             f"not planned: with every tensor split over all "
                             f"{cluster.num_devices} devices the step still needs "
                             f"{floor / 2**30:.2f} GiB, over the budget")})
            continue
        candidate = _within(candidate, deadline)
        if beside and one_stage_beside.is_shard(candidate):
            singles.append((name, candidate, len(rows)))
            rows.append({"name": name, "method": name.split(" ")[0]})  # filled in below
            continue
        row = plan_single(name, candidate, DEFER)
        if row is None:
            deferred.append((name, candidate, len(rows)))
            row = {"name": name, "method": name.split(" ")[0]}  # filled in below
        rows.append(row)
    ilp_notes: list[str] = []

    def plan_pipelines() -> None:
        pipelined = _within(method.pipeline_method(), deadline)
        traced = step.pipeline_traced
        assert traced is not None, "trace_auto traces the pipeline's outer program with its cut"
        began = time.perf_counter()
        try:
            found["pipeshard"] = plan_pipelined(step, pipelined, traced, cluster)
        except AutoparError as err:
            rows.append(failed_row("pipeshard", "pipeshard", err))
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
            ilp_notes.extend(n for n in planned.plan.notes if "stage-cost ILPs" in n)
            for row in inner:
                row = dict(row, name=f"pipeshard: {row['name']}")
                if row.pop("chosen", False):
                    note = row.get("note", "")
                    row.update(candidate_row(row["name"], planned.plan, budget))
                    row["note"] = "; ".join(n for n in (note, row["note"]) if n)
                rows.append(row)

    child = None
    if singles:
        one_stage_beside.trace_first(step, [c for _, c, _ in singles], cluster, budget)

        def plan_one(name: str, candidate: OneStageMethod) -> one_stage_beside.Planned:
            row = plan_single(name, candidate, DEFER)
            return row, found.get(name), phases.get(f"{name}_s", 0.0)

        child = one_stage_beside.start(step, [(n, c) for n, c, _ in singles], plan_one)
    pruned = step.pipeline is not None and method.prune and _cannot_win(
        found, budget, method, cluster, rows)
    try:
        if step.pipeline is not None and not pruned and within_budget("pipeshard"):
            plan_pipelines()
        answer = child.join() if child is not None else None
    except BaseException:  # an error, or Ctrl-C: the child is ended, not left behind
        if child is not None:
            child.cancel()
        raise
    if child is not None:
        outcomes, fastest, floors = answer if answer is not None else ([], {}, {})
        step.memo.fastest.update(fastest)
        step.memo.memory_floors.update(floors)
        done = {o.name: o for o in outcomes}
        for name, candidate, index in singles:
            outcome = done.get(name)
            if outcome is None or outcome.in_parent:  # the child failed, or had to trace
                row = plan_single(name, candidate, DEFER)
            else:
                row = outcome.row
                phases[f"{name}_s"] = outcome.seconds
                planned = one_stage_beside.program_of(step, outcome)
                if planned is not None:
                    found[name] = planned
                if row is not None:
                    step.status.solved()
            if row is None:
                deferred.append((name, candidate, index))
            else:
                rows[index] = row

    for name, candidate, index in deferred:
        fits = [p.plan.est_step_time_s for p in found.values() if fits_budget(p.plan, budget)]
        if fits and deadline is not None and time.perf_counter() >= deadline:
            skipped.append(name)
            rows[index] = skipped_row(name)
            continue
        row = plan_single(name, _within(candidate, deadline), min(fits) if fits else None)
        assert row is not None, "put off only when beat is DEFER; here it is a plan's estimate"
        rows[index] = row
    fitting = [(n, p) for n, p in found.items() if fits_budget(p.plan, budget)]
    # A one-stage pipeline is the one-stage ShardParallel step cut into microbatches: what it
    # adds (each microbatch reduces its gradients, smaller programs) its stage costs do not
    # price (docs/pipeline.md), so it is kept only for its memory, when no one-stage plan
    # fits; replicated with one microbatch per replica it is not cut at all
    one_stage_fits = any(n != "pipeshard" for n, _ in fitting)
    if one_stage_fits and "pipeshard" in found and _cut_one_stage(found["pipeshard"].plan):
        fitting = [(n, p) for n, p in fitting if n != "pipeshard"]
        for row in rows:
            if row.get("chosen_plan") is found["pipeshard"].plan:
                row["eligible"] = False
                row["note"] = "; ".join(x for x in (row.get("note", ""), (
                    "one stage: a one-stage plan fits, and the microbatch split's costs are "
                    "not in this estimate")) if x)
    if not fitting:
        least = min(found.values(), key=lambda p: p.plan.peak_memory_bytes, default=None)
        if least is None:
            raise PlanError(no_candidate_text(rows, budget))
        raise PlanError(
            f"no candidate of the full search fits in {budget / 2**30:.2f} GiB per device: the "
            f"least memory is {least.plan.peak_memory_bytes / 2**30:.2f} GiB "
            f"({least.plan.method.value}); raise memory_budget_bytes, or use a larger cluster")
    name, best = min(fitting, key=lambda item: item[1].plan.est_step_time_s)
    plan = best.plan
    chosen_name = next((r["name"] for r in rows if r.get("chosen_plan") is plan), name)
    for row in rows:
        row["chosen"] = row.pop("chosen_plan", None) is plan
    ranked = sorted((r for r in rows if r.get("est_step_time_s") is not None and r["fits"]
                     and r.get("eligible", True)),
                    key=lambda r: r["est_step_time_s"])
    runner_up = next((r for r in ranked if not r["chosen"]), None)
    summary = (f"the full search compared {len(rows)} candidate plans and chose "
               f"{chosen_name} (est. {plan.est_step_time_s:.4g} s/step)")
    if runner_up is not None:
        summary += (f"; next: {runner_up['name']} (est. {runner_up['est_step_time_s']:.4g} s, "
                    f"{runner_up['est_step_time_s'] / plan.est_step_time_s:.2f}x)")
    plan.notes.insert(0, summary)
    if step.annotations is not None:
        plan.notes.insert(1, annotations_note(step.annotations, rows, plan))
    if skipped:
        plan.notes.insert(1, f"the time budget ({method.time_budget_s:g} s) was spent before "
                             f"{', '.join(skipped)}: not planned")
    if step.pipeline is not None and "pipeshard" in found and plan is not \
            found["pipeshard"].plan:
        plan.notes.extend(f"pipelined candidates: {n}" for n in ilp_notes)
    options = {"method": "auto", "chosen": plan.method.value,
               "candidates": list(method.candidates),
               "num_microbatches": method.num_microbatches, "schedule": method.schedule,
               "remat": method.remat, "time_budget_s": method.time_budget_s,
               "skipped": skipped}
    plan.planning.method_options = options | {"chosen_options": plan.planning.method_options}
    plan.planning.candidates = rows
    plan.planning.planning_time_s = time.perf_counter() - start
    plan.planning.phases = phases | {"total_s": plan.planning.planning_time_s}
    return PlannedProgram(best.traced, plan, best.pipeline, candidates=found)


def _one_stage_candidates(
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


def _replicated_state_bytes(step: StepProgram, method: Method) -> float:
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


def _floor_without_recompute(step: StepProgram, method: Method, cluster: ClusterSpec) -> float:
    """The least bytes per device any plan of ``method`` needs when it does not recompute
    (ZeRO, data parallelism with ``remat="none"``): the step's memory floor with every tensor
    split over all the devices (``memory_floor``; no layout holds less). 0 for ShardParallel,
    which checks it itself, and for methods that may recompute to save activations. At
    Megatron's 1T row, estimating a ZeRO-3 plan that needs 11,278 GiB took 5 s; the floor
    (884 GiB) was known."""
    if isinstance(method, ShardParallel) or getattr(method, "remat", "none") != "none":
        return 0.0
    return step.memo.memory_floor(step.traced, step.batch_argnums, cluster.num_devices).total


def _within(method: M, deadline: float | None) -> M:
    """``method`` with its ILP time limit cut to the seconds left before ``deadline``."""
    if deadline is None or not isinstance(method, ShardParallel | PipeshardParallel | AutoParallel):
        return method
    left = max(deadline - time.perf_counter(), 0.05)
    return dataclasses.replace(method, time_limit_s=min(method.time_limit_s, left))


def _cannot_win(found: dict[str, PlannedProgram], budget: float, method: AutoParallel,
                cluster: ClusterSpec, rows: list[dict[str, Any]]) -> bool:
    """Whether a one-stage plan fitting the budget is estimated at or below the least driver
    time of any pipeline of two or more stages (``driver_floor_s``), so that no pipeline can
    be chosen (a one-stage pipeline is kept only for memory); if so, says why in ``rows``."""
    fitting = [p.plan.est_step_time_s for p in found.values() if fits_budget(p.plan, budget)]
    floor = driver_floor_s(method.pipeline_method(), cluster)
    if not fitting or min(fitting) > floor:
        return False
    rows.append({"name": "pipeshard", "method": "pipeshard", "est_step_time_s": None,
                 "fits": False, "note": (
                     f"not planned: any pipeline of two or more stages costs at least "
                     f"{floor * 1e3:.3g} ms a step in driver tasks on this cluster, and a "
                     f"one-stage plan that fits is estimated at {min(fitting) * 1e3:.3g} ms "
                     "(AutoParallel(prune=False) plans it anyway)")})
    return True


def _cut_one_stage(plan: Plan) -> bool:
    """Whether ``plan`` is one stage whose step is cut into several microbatches (per
    replica, where the pipeline is replicated)."""
    replicas = plan.pipeline.replicas if plan.pipeline is not None else 1
    return len(plan.stages) == 1 and plan.num_microbatches // replicas > 1
