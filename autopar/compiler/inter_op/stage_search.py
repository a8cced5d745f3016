"""Searching the stage DP's caps: Alpa's inter-operator search over ``t_max`` as branch and
bound (see :mod:`autopar.compiler.inter_op.stage_dp` for the DP and the argument), one shared
incumbent over the stage counts whose in-flight microbatches differ, and the error that says
why no stage assignment fits. Pure Python + numpy.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.compiler.inter_op.stage_dp import (
    DPAnswer,
    StageDPProblem,
    best_stage_count,
    run_dp,
    solve_capped,
)
from autopar.compiler.inter_op.stage_options import StageDPOptions
from autopar.errors import NoStageFitsError, PlanError

__all__ = ["StageSearch", "branch_and_bound", "no_fit_error", "search_stages", "thin_caps"]


def thin_caps(caps_descending: np.ndarray, limit: int) -> tuple[np.ndarray, float]:
    """At most ``limit`` caps, each at least a relative ``gap`` below the previous kept one."""
    positive = caps_descending[caps_descending > 0]
    spread = positive[0] / positive[-1] if len(positive) else 1.0
    gap = max(spread ** (1.0 / limit) - 1.0, 1e-9)
    while True:
        kept = [caps_descending[0]]
        for cap in caps_descending[1:]:
            if cap * (1.0 + gap) <= kept[-1]:
                kept.append(cap)
        if len(kept) <= limit:
            return np.array(kept), gap
        gap *= 1.5


def no_fit_error(
    problems: Sequence[StageDPProblem], num_hosts: int, per_host: int, options: StageDPOptions
) -> PlanError:
    """Why no stage assignment exists: missing candidates, or memory (with the least needed)."""
    need = math.inf
    for problem in problems:
        tables = run_dp(problem, problem.per_stage_count(problem.least_memory), np.maximum)
        need = min(need, best_stage_count(problem, tables)[1])
    layers = problems[0].num_layers if problems else 0
    where = f"{layers} layers on {num_hosts} hosts x {per_host} devices"
    if options.num_stages is not None:
        where += f" in {options.num_stages} stages"
    if not math.isfinite(need):
        return PlanError(f"no stage partition of {where} has a candidate for every stage")
    budget = options.memory_budget_bytes
    assert budget is not None, "without a budget every stage with candidates fits"
    chunks = f", {options.num_chunks} chunks per stage" if options.num_chunks > 1 else ""
    return NoStageFitsError(
        f"no stage assignment of {where} fits in {budget:.0f} bytes "
        f"({budget / 2**30:.2f} GiB) per device: the smallest needs {need:.0f} bytes "
        f"({need / 2**30:.2f} GiB) per device (schedule {options.schedule}, "
        f"{options.num_microbatches} microbatches{chunks})", need)


def branch_and_bound(
    attempt: Callable[[float], DPAnswer],
    best_total: Callable[[], float],
    caps: np.ndarray,
    sum_floor: float,
    m: int,
    limit: int,
) -> float:
    """Visit the stage-time caps that may hold a better pipeline; return the thinning gap.

    ``caps`` (ascending) are the distinct stage times strictly between the smallest feasible
    cap and the uncapped answer's slowest stage. An interval ``[lo, hi]`` of caps stands for
    the partitions whose slowest stage is in ``[caps[lo], caps[hi]]``; each has a sum of at
    least ``sum_above`` (the DP answer of a cap above the interval), so none can beat
    ``sum_above + (m - 1) * caps[lo]``. Intervals are opened best bound first; the DP at the
    middle cap removes the partitions it dominates (slowest stage in [its max, cap]) and
    splits the rest in two. After ``limit`` DP runs the remaining caps are thinned.
    """
    heap: list[tuple[float, int, int, float]] = []

    def push(lo: int, hi: int, sum_above: float) -> None:
        # Reads ``caps`` at call time: after thinning it is the thinned array.
        best = best_total()
        if m > 1:
            # A partition whose slowest stage is t totals at least sum_floor + (m - 1) t.
            too_slow = int(np.searchsorted(caps, (best - sum_floor) / (m - 1), side="left"))
            hi = min(hi, too_slow - 1)
        bound = sum_above + (m - 1) * float(caps[lo]) if lo <= hi else math.inf
        if bound < best:
            heapq.heappush(heap, (bound, lo, hi, sum_above))

    push(0, len(caps) - 1, sum_floor)
    gap, runs = 0.0, 0
    while heap:
        bound, lo, hi, sum_above = heapq.heappop(heap)
        if bound >= best_total():
            break  # every interval left is bounded at least as high
        if gap == 0.0 and runs >= limit:
            # Too many DP runs for an exact search: keep a thinned subset of the open caps.
            open_caps = np.unique(
                np.concatenate([caps[lo : hi + 1]] + [caps[i : j + 1] for _, i, j, _ in heap])
            )
            thinned, gap = thin_caps(open_caps[::-1], limit)
            thinned = thinned[::-1]
            intervals = [(lo, hi, sum_above)] + [(i, j, above) for _, i, j, above in heap]
            old_caps, caps, heap = caps, thinned, []
            for i, j, above in intervals:
                new_lo = int(np.searchsorted(caps, old_caps[i], side="left"))
                new_hi = int(np.searchsorted(caps, old_caps[j], side="right")) - 1
                push(new_lo, new_hi, above)
            continue
        middle = (lo + hi) // 2
        answer = attempt(float(caps[middle]))
        runs += 1
        below = int(np.searchsorted(caps, answer.max_time, side="left")) - 1
        push(lo, min(below, middle - 1), answer.stage_sum)
        push(middle + 1, hi, sum_above)
    return gap


@dataclass(frozen=True)
class StageSearch:
    """The search's outcome: the best answer (``best.candidates`` index its stages' table
    entries) and the problem it answers, the thinning gap (0.0: exact), the DP runs."""

    best: DPAnswer
    problem: StageDPProblem
    gap: float
    num_tried: int


@dataclass
class _Bounds:
    """One problem's first DP runs: its smallest feasible cap, the uncapped answer, and the
    least total any of its partitions can have."""

    problem: StageDPProblem
    t_low: float
    unlimited: DPAnswer
    floor: float


def search_stages(
    problems: Sequence[StageDPProblem], num_hosts: int, per_host: int, options: StageDPOptions
) -> StageSearch:
    """The answer minimising ``sum(t_i) + (m - 1) * max(t_i)`` over all stage-time caps of all
    ``problems`` (one, or one per fixed stage count: :func:`prepare_problems`).

    Each problem's caps are searched by :func:`branch_and_bound` against the best answer of any
    problem so far; a problem whose least possible total (its uncapped stage sum plus m - 1
    times its smallest feasible cap) cannot beat that answer is not searched further. Raises
    :func:`no_fit_error`'s PlanError when no assignment exists at any cap.
    """
    m = options.num_microbatches
    answers: list[tuple[DPAnswer, StageDPProblem]] = []

    def best_total() -> float:
        return min((answer.total for answer, _ in answers), default=math.inf)

    bounds = []
    for problem in problems:
        # The smallest t_max for which any assignment exists: a min-max DP over the same table.
        bottleneck = run_dp(problem, problem.per_stage_count(problem.best_time), np.maximum)
        _, t_low = best_stage_count(problem, bottleneck)
        if not math.isfinite(t_low):
            continue
        unlimited = solve_capped(problem, math.inf, m)
        assert unlimited is not None, "a finite smallest cap means an uncapped answer exists"
        answers.append((unlimited, problem))
        floor = unlimited.stage_sum + (m - 1) * t_low
        bounds.append(_Bounds(problem, t_low, unlimited, floor))
    if not bounds:
        raise no_fit_error(problems, num_hosts, per_host, options)

    gap = 0.0
    for bound in sorted(bounds, key=lambda b: b.floor):
        if len(bounds) > 1 and bound.floor >= best_total():
            continue  # nothing with this stage count can beat the best answer so far
        problem, unlimited, t_low = bound.problem, bound.unlimited, bound.t_low

        def attempt(t_max: float, problem: StageDPProblem = problem) -> DPAnswer:
            answer = solve_capped(problem, t_max, m)
            assert answer is not None, "t_max >= the smallest feasible cap always has an answer"
            answers.append((answer, problem))
            return answer

        if t_low < unlimited.max_time:
            attempt(t_low)  # often the winner when m is large; tightens the bounds below early
        # Every stage time the DP can pick is a cap worth trying; caps at or above the uncapped
        # answer's slowest stage return that answer again, caps at t_low or below were handled.
        distinct = np.unique(
            np.concatenate([t[np.isfinite(t)] for t in problem.fit_time.values()])
        )
        caps = distinct[(distinct > t_low) & (distinct < unlimited.max_time)]
        found_gap = branch_and_bound(
            attempt, best_total, caps, unlimited.stage_sum, m, options.max_tmax_candidates
        )
        gap = max(gap, found_gap)
    best, problem = min(answers, key=lambda pair: pair[0].total)
    return StageSearch(best=best, problem=problem, gap=float(gap), num_tried=len(answers))
