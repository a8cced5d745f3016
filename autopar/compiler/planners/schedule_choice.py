"""``PipeshardParallel(schedule="auto")``: plan each candidate schedule, keep the fastest.

The synchronous candidates are 1F1B and ZB-H1 (GPipe never beats 1F1B's time and holds more
activations; interleaved 1F1B needs uniform stages). The asynchronous ones, PipeDream and
PipeDream-2BW, are candidates only with ``allow_async=True``: they change the training
algorithm (weight staleness), which is the user's call, not the planner's. Each candidate is
planned in full (its own stage search, whose memory counts its activations in flight and its
weight versions), sharing the layer costs, and only the fastest has its stages solved whole
(``finish_pipeshard``); one that cannot be planned (nothing fits, too few microbatches for
2BW) is listed with why. The plan says what it chose, what 1F1B would have
taken, and, for an asynchronous choice, the weight versions and staleness per stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.planners.pipeline_search import PipeshardSearch, search_pipeshard
from autopar.compiler.planners.pipeshard import finish_pipeshard, plan_pipeshard
from autopar.compiler.planners.stage_costs import layer_cost_cache
from autopar.errors import InvalidOptionError, PlanError
from autopar.ir.async_schedules import weight_versions
from autopar.ir.pipeline_program import PipelineProgram
from autopar.ir.schedule_orders import weight_version_counts
from autopar.ir.schedules import ScheduleName, is_async
from autopar.methods import SCHEDULE_AUTO, PipeshardParallel
from autopar.plan import MethodName, Plan

SYNCHRONOUS_CANDIDATES = (ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1)
ASYNCHRONOUS_CANDIDATES = (ScheduleName.PIPEDREAM, ScheduleName.PIPEDREAM_2BW)


def auto_schedules(allow_async: bool) -> tuple[ScheduleName, ...]:
    """The schedules ``schedule="auto"`` compares."""
    return SYNCHRONOUS_CANDIDATES + (ASYNCHRONOUS_CANDIDATES if allow_async else ())


def async_summary(plan: Plan) -> str | None:
    """For an asynchronous plan, one line: the weight versions live and the staleness per
    stage (None for other plans)."""
    layout = plan.pipeline
    if layout is None or not is_async(layout.schedule):
        return None
    p, m = len(plan.stages), plan.num_microbatches
    versions = weight_version_counts(layout.schedule, p, m)
    rules = weight_versions(layout.schedule, p, m)
    return (f"asynchronous schedule {layout.schedule}: the training algorithm is not the "
            f"synchronous step's; weight versions live per stage {list(versions)}, staleness "
            f"in updates per stage {[rules.staleness(s) for s in range(p)]}")


def plan_pipeline(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                  cluster_name: str | None = None, *, cache: Any = None) -> Plan:
    """``plan_pipeshard``, or with ``schedule="auto"`` :func:`choose_schedule`."""
    if method.schedule == SCHEDULE_AUTO:
        return choose_schedule(pp, method, cluster, cluster_name, cache=cache)
    return plan_pipeshard(pp, method, cluster, cluster_name, cache=cache)


def choose_schedule(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                    cluster_name: str | None = None, *, cache: Any = None) -> Plan:
    """The fastest plan over :func:`auto_schedules` (PlanError, one line, when none can be
    planned, with each schedule's reason)."""
    cache = cache if cache is not None else layer_cost_cache(method)
    searches: dict[ScheduleName, PipeshardSearch] = {}
    why: dict[ScheduleName, str] = {}
    for name in auto_schedules(method.allow_async):
        try:
            searches[name] = search_pipeshard(pp, dataclasses.replace(method, schedule=name),
                                              cluster, cache=cache)
        except (PlanError, InvalidOptionError) as exc:
            why[name] = str(exc)
    if not searches:
        reasons = "; ".join(f"{name}: {text}" for name, text in why.items())
        raise PlanError(f"schedule='auto' found no schedule that plans: {reasons}")
    # only the kept schedule's stages are solved whole: that does not change its estimate
    times = {name: found.best.estimate.total_s for name, found in searches.items()}
    best = min(times, key=times.__getitem__)
    plan = finish_pipeshard(searches[best], cluster_name)
    # every schedule's search took its share (the first filled the layer costs the others
    # read): the phases are their sums, each search's seconds beside
    phases = dict(plan.planning.phases)
    for part in ("layers_s", "stage_costs_s", "stage_dp_s"):
        phases[part] = sum(getattr(found, part) for found in searches.values())
    for name, found in searches.items():
        phases[f"search {name}_s"] = found.layers_s + found.stage_costs_s + found.stage_dp_s
    phases["total_s"] = sum(phases[p] for p in ("layers_s", "stage_costs_s", "stage_dp_s",
                                                   "stage_plans_s"))
    rows = []
    for name in auto_schedules(method.allow_async):
        rows.append({"name": f"schedule {name}", "method": MethodName.PIPESHARD.value,
                     "est_step_time_s": times.get(name),
                     "fits": name in times, "chosen": name == best,
                     "note": why.get(name, "asynchronous" if is_async(name) else "")})
    notes = [f"schedule auto{' (asynchronous allowed)' if method.allow_async else ''}: chose "
             f"{best} (est. {plan.est_step_time_s:.4g} s/step)"]
    reference = times.get(ScheduleName.ONE_F_ONE_B)
    if reference is not None and best != ScheduleName.ONE_F_ONE_B:
        notes[0] += (f"; 1f1b est. {reference:.4g} s/step, estimated "
                     f"throughput {reference / plan.est_step_time_s:.2f}x 1f1b's")
    summary = async_summary(plan)
    if summary is not None:
        notes.append(summary)
    return plan.noted(*notes, first=True).with_planning(
        phases=phases, candidates=rows,
        method_options=plan.planning.method_options | {
            "schedule": SCHEDULE_AUTO, "allow_async": method.allow_async,
            "chosen_schedule": str(best)})
