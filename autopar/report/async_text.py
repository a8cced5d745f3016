"""What the report says about an asynchronous pipeline (PipeDream, PipeDream-2BW).

Its swimlane is the steady state (three steps back to back: the pipeline fills once and is
not flushed between steps), and beside it: the weight versions each stage keeps, the
staleness of its gradients in updates, and the schedule's time per step against 1F1B's on
the same stages (device time of the schedule alone, both simulated the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopar.ir.async_schedules import weight_versions
from autopar.ir.schedule_orders import weight_version_counts
from autopar.ir.schedule_timeline import Timeline, stage_timeline, steady_state
from autopar.ir.schedules import ScheduleName, is_async
from autopar.plan import Plan

STEPS_DRAWN = 3


def async_timeline(plan: Plan) -> Timeline | None:
    """The steady-state timeline of an asynchronous plan (None for other plans)."""
    layout = plan.pipeline
    if layout is None or not is_async(layout.schedule):
        return None
    times = [s.est_time_s for s in plan.stages]
    return steady_state(layout.schedule, times, plan.num_microbatches,
                        num_calls=STEPS_DRAWN).timeline


def async_facts(plan: Plan) -> dict[str, Any] | None:
    """Weight versions and staleness per stage, and the schedule's time per step against
    1F1B's on the same stages (None for plans that are not asynchronous)."""
    layout = plan.pipeline
    if layout is None or not is_async(layout.schedule):
        return None
    p, m = len(plan.stages), plan.num_microbatches
    times = [s.est_time_s for s in plan.stages]
    steady = steady_state(layout.schedule, times, m)
    one_f_one_b = stage_timeline(ScheduleName.ONE_F_ONE_B, times, m).makespan
    return {
        "weight_versions": list(weight_version_counts(layout.schedule, p, m)),
        "staleness_updates": [weight_versions(layout.schedule, p, m).staleness(s)
                              for s in range(p)],
        "schedule_s_per_step": steady.call_s,
        "steady_idle_fraction": steady.idle_fraction,
        "one_f_one_b_schedule_s": one_f_one_b,
        "throughput_vs_1f1b": one_f_one_b / steady.call_s if steady.call_s > 0 else None,
    }


def async_lines(plan: Plan, format_seconds: Callable[[float], str]) -> list[str]:
    """The report's lines about an asynchronous plan (empty for other plans), durations as
    ``format_seconds`` writes them (the text report's)."""
    facts = async_facts(plan)
    if facts is None:
        return []
    ratio = facts["throughput_vs_1f1b"]
    return [
        f"  asynchronous: the training algorithm changes (docs/pipeline.md); weight versions "
        f"live per stage {facts['weight_versions']}, staleness in updates per stage "
        f"{facts['staleness_updates']}",
        f"  steady state: {format_seconds(facts['schedule_s_per_step'])} of schedule per step, "
        f"idle {facts['steady_idle_fraction']:.3f}; 1f1b on these stages "
        f"{format_seconds(facts['one_f_one_b_schedule_s'])}: estimated throughput "
        + (f"{ratio:.2f}x 1f1b's" if ratio is not None else "-"),
        f"  swimlane below: {STEPS_DRAWN} steps back to back (one fill, no flush between "
        "steps)",
    ]
