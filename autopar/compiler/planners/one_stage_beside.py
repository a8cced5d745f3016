"""The full search's ShardParallel candidates planned in a forked child while this process
plans the pipelines: the two halves of the search are independent until their plans are
compared, and each is mostly one core's work (at GPT-3 175B on 1,024 A100s the three
whole-model ILPs took 59 s of a 143 s search, the pipelines 65 s, one after the other).

Only what does not call JAX runs in the child: the rematerialised step those candidates plan
from is traced here first when the memory floor shows they will need it, and a child that
would have to trace anyway (``TraceNeeded``) leaves that candidate to this process. What comes
back is each candidate's row, plan, fastest plans and memory floors (``TraceMemo``'s, so that
the search's second look at a candidate over the budget does not solve it again); the problems the
child built are not sent (they are large, and only a candidate that can win needs them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.inter_op.forked import Beside, available_cores, start_beside
from autopar.compiler.planners.pipeline_search import driver_floor_s
from autopar.compiler.planners.step_program import PlannedProgram, StepProgram, TraceNeeded
from autopar.method_options import RematMode
from autopar.methods import AutoParallel, Method, OneStageMethod, ShardParallel
from autopar.plan import Plan

# Graphs smaller than this plan their one-stage candidates in this process: a fork costs tens
# of milliseconds and the child's memory, and below a few thousand equations (the zoo's tiny
# models, GPT-2.6B's 1,700-node steps) the candidates take about a second.
BESIDE_MIN_NODES = 5000

# ``plan_one(name, candidate)``: the full search's planning of one candidate, its row (None:
# put off until the pipelines are planned), the program and plan it found (None: none) and the
# seconds it took
Planned = tuple[dict[str, Any] | None, PlannedProgram | None, float]
PlanOne = Callable[[str, OneStageMethod], Planned]


@dataclass(frozen=True)
class Outcome:
    """One candidate planned in the child: its row (None: deferred), its plan and whether
    that plan is of the rematerialised step, the seconds; ``in_parent``: the child could
    not plan it without tracing, so this process does."""

    name: str
    row: dict[str, Any] | None = None
    plan: Plan | None = None
    rematerialised: bool = False
    seconds: float = 0.0
    in_parent: bool = False


def plans_beside(step: StepProgram, method: AutoParallel, cluster: ClusterSpec,
                 ilp_observer: Any, deadline: float | None) -> bool:
    """Whether the ShardParallel candidates are planned beside the pipelines: a pipeline
    will be planned, there are two cores to use (``planning_workers``), the step is large,
    nothing watches each ILP from this process (``ilp_observer``), no time budget orders the
    candidates one after the other, and no one-stage plan can make the pipelines not worth
    planning (``prune``: one estimated below any pipeline's driver time; no plan is faster
    than the step's flops over every device at its peak)."""
    workers = method.planning_workers or available_cores()
    if not (step.pipeline is not None and workers >= 2 and hasattr(os, "fork")
            and deadline is None and ilp_observer is None
            and len(step.traced.graph.nodes) >= BESIDE_MIN_NODES):
        return False
    if not method.prune:
        return True
    peak = max(cluster.device.peak_flops.values()) * cluster.num_devices
    return step.traced.graph.total_flops / peak > driver_floor_s(
        step.pipeline, method.pipeline_method(), cluster)


def trace_first(step: StepProgram, candidates: Sequence[Method], cluster: ClusterSpec,
                budget: float) -> None:
    """Trace the rematerialised step here when a candidate will plan from it: ``remat =
    "layers"``, or ``"auto"`` with the plain step's memory floor over ``budget`` (no plan of
    it fits, so recomputation is tried)."""
    modes = {getattr(c, "remat", RematMode.NONE) for c in candidates}
    if RematMode.LAYERS not in modes and RematMode.AUTO not in modes:
        return
    if RematMode.LAYERS not in modes:
        floor = step.memo.memory_floor(step.traced, step.batch_argnums, cluster.num_devices)
        if floor.total <= budget:
            return
    step.rematerialised()


def start(step: StepProgram, singles: Sequence[tuple[str, OneStageMethod]],
          plan_one: PlanOne) -> Beside:
    """A child planning ``singles`` (name, candidate) with ``plan_one``; its ``join`` gives
    ``(outcomes, fastest plans, memory floors)`` (``TraceMemo``'s)."""

    def work() -> tuple[list[Outcome], dict[tuple, Plan], dict[tuple, Any]]:
        step.memo.may_trace = False
        outcomes = []
        for name, candidate in singles:
            try:
                row, planned, seconds = plan_one(name, candidate)
            except TraceNeeded:
                outcomes.append(Outcome(name, in_parent=True))
                continue
            remat = planned is not None and planned.traced is not step.traced
            outcomes.append(Outcome(name, row, None if planned is None else planned.plan,
                                    remat, seconds))
        return outcomes, step.memo.fastest, step.memo.memory_floors

    return start_beside(work)


def program_of(step: StepProgram, outcome: Outcome) -> PlannedProgram | None:
    """The child's plan with the program it was made from (this process's copy)."""
    if outcome.plan is None:
        return None
    if not outcome.rematerialised:
        return PlannedProgram(step.traced, outcome.plan)
    remat = step.memo.remat
    assert isinstance(remat, tuple), "the child planned from the step traced here"
    return PlannedProgram(remat[0], outcome.plan)


def is_shard(candidate: Method) -> bool:
    """The candidates planned beside the pipelines: the ShardParallel ones (data parallelism
    and ZeRO take a moment, or are refused by their memory floors before planning)."""
    return isinstance(candidate, ShardParallel)
