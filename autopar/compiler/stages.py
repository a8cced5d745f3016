"""Stage construction: Alpa's inter-operator dynamic program.

The model's ``L`` layers are cut into contiguous stages, each placed on a submesh
(:mod:`autopar.compiler.submesh`). The caller prices every (layer range, submesh) pair with one
:class:`StageCandidate` per logical mesh shape it tried; this module picks the stages that
minimise the pipeline latency

    total = sum_i t_i + (m - 1) * max_i t_i          (m microbatches)

using all devices of the cluster, with every stage's per-device memory (fixed memory plus one
set of activations per in-flight microbatch) within the budget.

Search. For a cap ``t_max`` the DP ``F(s, k, d)`` (min sum of stage times covering layers
``k..L-1`` with ``s`` stages on ``d`` devices, every stage time <= t_max, every stage within the
memory budget with the in-flight microbatches of its position) is solved with numpy over all
(k, e, d) at once per stage count. Rather than sweeping every distinct candidate time, the caps
are searched by branch and bound: a DP answer at cap T with slowest stage M dominates every
partition whose slowest stage lies in [M, T] (no smaller sum, no smaller max), and a range of
caps [a, b] below a known answer of sum S can hold nothing better than S + (m - 1) a. The
uncapped DP and a min-max DP (the smallest feasible cap) bound the range. This is exact; only
after ``max_tmax_candidates`` DP runs are the caps still open thinned with Alpa's relative gap,
and :attr:`StagePartition.exact` says whether that happened.

Submesh shapes, candidates and the cost table live in :mod:`autopar.compiler.submesh` and are
re-exported here. Pure Python + numpy; no devices, no JAX.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.compiler.submesh import (
    CandidateFn,
    StageCandidate,
    StageCostTable,
    SubmeshShape,
    always_packs,
    place_submeshes,
    submesh_shapes,
)
from autopar.errors import InvalidOptionError, PlanError, choices_text

__all__ = [
    "SCHEDULES",
    "CandidateFn",
    "StageAssignment",
    "StageCandidate",
    "StageCostTable",
    "StageDPOptions",
    "StagePartition",
    "SubmeshShape",
    "in_flight_microbatches",
    "manual_stages",
    "pipeline_time",
    "place_submeshes",
    "solve_stages",
    "submesh_shapes",
    "uniform_stages",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def in_flight_microbatches(schedule: str, stages_from_end: int, num_microbatches: int) -> int:
    """Microbatches whose activations a stage holds at once under ``schedule``.

    ``stages_from_end`` counts the stages from this one to the last, inclusive. GPipe runs all
    forwards before any backward, so every stage keeps all ``m``; the 1F1B family (plain,
    interleaved, zero-bubble H1) starts backwards as soon as the last stage can, so a stage
    keeps at most one microbatch per stage downstream of it, itself included.
    """
    if schedule not in SCHEDULES:
        raise InvalidOptionError(
            f"unknown pipeline schedule {schedule!r}; choices: {choices_text(SCHEDULES)}"
        )
    if stages_from_end < 1 or num_microbatches < 1:
        raise InvalidOptionError(
            f"stages_from_end ({stages_from_end}) and num_microbatches ({num_microbatches}) "
            "must be positive"
        )
    if schedule == "gpipe":
        return num_microbatches
    return min(stages_from_end, num_microbatches)


@dataclass(frozen=True)
class StageDPOptions:
    """What the stage DP optimises for.

    ``memory_budget_bytes`` is per device (None: unlimited). ``num_stages`` fixes the stage
    count (None: any). ``max_tmax_candidates`` bounds the DP runs of the exact search; past it,
    the caps still to visit are thinned with a relative gap (at most that many again) and the
    result is reported as not exact.
    """

    num_microbatches: int = 1
    schedule: str = "1f1b"
    memory_budget_bytes: float | None = None
    num_stages: int | None = None
    max_tmax_candidates: int = 512

    def __post_init__(self) -> None:
        for name in ("num_microbatches", "max_tmax_candidates"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"{name} must be a positive integer, got {value!r}")
        if self.num_stages is not None and (
            not isinstance(self.num_stages, numbers.Integral) or self.num_stages < 1
        ):
            raise InvalidOptionError(
                f"num_stages must be a positive integer or None, got {self.num_stages!r}"
            )
        budget = self.memory_budget_bytes
        if budget is not None and (
            not isinstance(budget, numbers.Real) or not math.isfinite(budget) or budget < 0
        ):
            raise InvalidOptionError(
                f"memory_budget_bytes must be a finite non-negative number or None, got {budget!r}"
            )
        in_flight_microbatches(self.schedule, 1, 1)  # validates the schedule name

    def in_flight(self, stages_from_end: int) -> int:
        """In-flight microbatches of a stage with ``stages_from_end`` stages from it to the end."""
        return in_flight_microbatches(self.schedule, stages_from_end, self.num_microbatches)

    def fits(self, memory_bytes: float) -> bool:
        """Whether ``memory_bytes`` per device is within the budget."""
        return self.memory_budget_bytes is None or memory_bytes <= self.memory_budget_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "memory_budget_bytes": self.memory_budget_bytes,
            "num_stages": self.num_stages,
            "max_tmax_candidates": self.max_tmax_candidates,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageDPOptions:
        """Inverse of :meth:`to_dict`; missing fields take their defaults."""
        known = set(cls().to_dict())
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidOptionError(
                f"unknown stage DP option(s) {choices_text(unknown)}; choices: "
                f"{choices_text(sorted(known))}"
            )
        return cls(**dict(data))


@dataclass(frozen=True)
class StageAssignment:
    """One stage: layers ``[start, end)`` on ``submesh``, run as ``candidate``."""

    start: int
    end: int
    submesh: SubmeshShape
    candidate: StageCandidate

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "start": self.start,
            "end": self.end,
            "submesh": self.submesh.to_dict(),
            "candidate": self.candidate.to_dict(),
        }


@dataclass(frozen=True)
class StagePartition:
    """A chosen set of stages and its pipeline latency.

    ``total_time = sum(t_i) + (num_microbatches - 1) * max_stage_time``. ``exact`` is False when
    the search thinned the stage-time caps (``tmax_relative_gap`` > 0), so a better partition
    may exist; ``num_tmax_tried`` counts the DP runs (0 for evaluated baselines).
    """

    stages: tuple[StageAssignment, ...]
    num_microbatches: int
    total_time: float
    max_stage_time: float
    exact: bool
    num_tmax_tried: int
    tmax_relative_gap: float = 0.0

    @property
    def submeshes(self) -> tuple[SubmeshShape, ...]:
        """The stages' submesh shapes, in stage order."""
        return tuple(stage.submesh for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "stages": [stage.to_dict() for stage in self.stages],
            "num_microbatches": self.num_microbatches,
            "total_time": self.total_time,
            "max_stage_time": self.max_stage_time,
            "exact": self.exact,
            "num_tmax_tried": self.num_tmax_tried,
            "tmax_relative_gap": self.tmax_relative_gap,
        }


def pipeline_time(stage_times: Sequence[float], num_microbatches: int) -> float:
    """``sum(t_i) + (m - 1) * max(t_i)``: one iteration's latency through the pipeline."""
    return float(sum(stage_times) + (num_microbatches - 1) * max(stage_times))


# ----------------------------------------------------------------------------- the DP


@dataclass(frozen=True)
class _Problem:
    """The cost table as dense arrays over (start k, end e, usable submesh j[, candidate]).

    ``best_time[f]`` is the fastest candidate's time among those fitting the budget with ``f``
    microbatches in flight (inf if none), ``best_index[f]`` its position in the table entry, and
    ``least_memory[f]`` the smallest memory any candidate needs with ``f`` in flight. Capping the
    stage time at t_max only masks ``best_time``: the fastest fitting candidate either meets the
    cap or no fitting candidate does.
    """

    num_layers: int
    num_devices: int
    table_index: tuple[int, ...]  # usable submesh j -> index in the table
    sizes: np.ndarray  # devices of usable submesh j
    top_stages: int  # largest stage count the DP builds
    fixed_stages: int | None
    in_flight: tuple[int, ...]  # in_flight[s] for s = 1..top_stages (index 0 unused)
    best_time: Mapping[int, np.ndarray]
    best_index: Mapping[int, np.ndarray]
    least_memory: Mapping[int, np.ndarray]

    def per_stage_count(self, by_in_flight: Mapping[int, np.ndarray]) -> list[np.ndarray]:
        """``costs[s]`` for s = 1..top (``costs[0]`` is unused)."""
        return [by_in_flight[self.in_flight[max(s, 1)]] for s in range(self.top_stages + 1)]


def _prepare(
    table: StageCostTable, num_hosts: int, per_host: int, options: StageDPOptions
) -> _Problem:
    layers, devices = table.num_layers, num_hosts * per_host
    usable = tuple(
        i for i, sm in enumerate(table.submeshes) if always_packs(sm, num_hosts, per_host)
    )
    if not usable:
        raise PlanError(
            f"no submesh of the cost table ({choices_text(table.submeshes)}) is usable on "
            f"{num_hosts} hosts x {per_host} devices (whole hosts, or a power-of-two slice "
            f"dividing {per_host})"
        )
    wanted = options.num_stages
    if wanted is not None and (wanted > layers or wanted > devices):
        raise PlanError(
            f"num_stages={wanted} is more than the {layers} layers or the {devices} devices "
            f"({num_hosts} hosts x {per_host}); choose at most {min(layers, devices)}"
        )
    top = wanted if wanted is not None else min(layers, devices)
    entries = [
        (k, e, j, table.candidates(k, e, i))
        for k in range(layers)
        for e in range(k + 1, layers + 1)
        for j, i in enumerate(usable)
    ]
    width = max([1] + [len(found) for *_, found in entries])
    shape = (layers, layers + 1, len(usable), width)
    times, fixed, act = np.full(shape, np.inf), np.full(shape, np.inf), np.zeros(shape)
    at = [(k, e, j, c) for k, e, j, found in entries for c in range(len(found))]
    if at:
        where = tuple(np.array(axis) for axis in zip(*at, strict=True))
        chosen = [entry[3][c] for entry in entries for c in range(len(entry[3]))]
        times[where] = [c.time for c in chosen]
        fixed[where] = [c.fixed_memory for c in chosen]
        act[where] = [c.activation_memory_per_microbatch for c in chosen]
    in_flight = tuple(options.in_flight(max(s, 1)) for s in range(top + 1))
    budget = np.inf if options.memory_budget_bytes is None else options.memory_budget_bytes
    best_time, best_index, least_memory = {}, {}, {}
    for f in sorted(set(in_flight[1:])):
        need = fixed + f * act  # inf for padding slots: they never fit
        fitting_times = np.where(need <= budget, times, np.inf)
        index = np.argmin(fitting_times, axis=-1)
        best_index[f] = index
        best_time[f] = np.take_along_axis(fitting_times, index[..., None], axis=-1)[..., 0]
        least_memory[f] = need.min(axis=-1)
    return _Problem(
        num_layers=layers,
        num_devices=devices,
        table_index=usable,
        sizes=np.array([table.submeshes[i].num_devices for i in usable]),
        top_stages=top,
        fixed_stages=wanted,
        in_flight=in_flight,
        best_time=best_time,
        best_index=best_index,
        least_memory=least_memory,
    )


Combine = Callable[..., np.ndarray]  # np.add (sum of stage times) or np.maximum (bottleneck)


def _run_dp(problem: _Problem, costs: Sequence[np.ndarray], combine: Combine) -> list[np.ndarray]:
    """``tables[s][k, d]``: best value covering layers k..L-1 with s stages on d devices.

    Built one stage count at a time: ``F(s, k, d) = min over e > k, j of
    cost_s[k, e, j] (+ or max) F(s - 1, e, d - n_j)``, vectorised over k, e and d. Only stage
    lengths up to the longest finite entry of each submesh are visited: under a low stage-time
    cap, long ranges on small submeshes are all infinite, which shrinks the work several-fold.
    """
    layers, devices = problem.num_layers, problem.num_devices
    lengths = np.arange(layers + 1)[None, :] - np.arange(layers)[:, None]  # e - k
    bands: dict[int, np.ndarray] = {}  # id(cost array) -> longest finite stage per submesh
    empty = np.full((layers + 1, devices + 1), np.inf)
    empty[layers, 0] = 0.0  # zero stages cover zero layers on zero devices
    tables = [empty]
    for s in range(1, problem.top_stages + 1):
        cost = costs[s]
        if id(cost) not in bands:
            bands[id(cost)] = np.where(np.isfinite(cost), lengths[..., None], 0).max(axis=(0, 1))
        band = bands[id(cost)]
        # Earlier stages need a layer each (when the count is fixed); later ones too.
        k_low = 0 if problem.fixed_stages is None else problem.fixed_stages - s
        k_high, e_high = layers - s, layers - s + 1
        current = np.full((layers + 1, devices + 1), np.inf)
        starts = np.arange(max(k_low, 0), k_high + 1)
        if s == 1:
            for j, size in enumerate(problem.sizes):
                if size <= devices:
                    column = combine(cost[starts, layers, j], 0.0)
                    current[starts, size] = np.minimum(current[starts, size], column)
        elif len(starts) and band.max() > 0:
            reach = int(min(band.max(), e_high - starts[0]))
            ends = starts[:, None] + np.arange(1, reach + 1)[None, :]  # (k, offset)
            beyond = ends > e_high
            ends = np.minimum(ends, e_high)
            rest = tables[-1][ends]  # (k, offset, d): the best of the stages after this one
            stage_costs = np.where(beyond[..., None], np.inf, cost[starts[:, None], ends])
            best = np.full((len(starts), devices + 1), np.inf)
            scratch = np.empty_like(rest)
            for j, size in enumerate(problem.sizes):
                width = int(min(band[j], reach))
                if size > devices or width == 0:
                    continue
                view = scratch[:, :width]
                view[:, :, :size] = np.inf
                combine(
                    stage_costs[:, :width, j, None],
                    rest[:, :width, : devices + 1 - size],
                    out=view[:, :, size:],
                )
                np.minimum(best, view.min(axis=1), out=best)
            current[starts] = best
        tables.append(current)
        if not np.isfinite(current).any():
            break  # more stages cannot do better than none
    return tables


def _best_stage_count(problem: _Problem, tables: Sequence[np.ndarray]) -> tuple[int, float]:
    """(stage count, value) of the best answer for all layers on all devices."""
    counts = [problem.fixed_stages] if problem.fixed_stages is not None else range(1, len(tables))
    values = [(tables[s][0, problem.num_devices], s) for s in counts if s < len(tables)]
    value, count = min(values, default=(np.inf, 0))
    return count, float(value)


def _backtrack(
    problem: _Problem,
    tables: Sequence[np.ndarray],
    costs: Sequence[np.ndarray],
    combine: Combine,
    count: int,
) -> list[tuple[int, int, int]]:
    """The (start, end, submesh j) stages of the answer with ``count`` stages.

    Recomputes the DP step only along the answer's path: the value at each state equals, bit
    for bit, the combine of its chosen predecessor, so the first exact match is a valid choice.
    """
    layers, d, k = problem.num_layers, problem.num_devices, 0
    stages = []
    for s in range(count, 0, -1):
        target = tables[s][k, d]
        ends = np.arange(k + 1, layers + 1)
        left = d - problem.sizes
        ok = left >= 0
        rest = np.full((len(ends), len(problem.sizes)), np.inf)
        rest[:, ok] = tables[s - 1][ends][:, left[ok]]
        values = combine(costs[s][k, k + 1 :], rest)
        e_pos, j = np.argwhere(values == target)[0]
        stages.append((k, int(ends[e_pos]), int(j)))
        k, d = int(ends[e_pos]), int(left[j])
    return stages


# ----------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class _Answer:
    """One DP answer: stages as (start, end, usable submesh j, in-flight count)."""

    stages: tuple[tuple[int, int, int, int], ...]
    times: tuple[float, ...]
    stage_sum: float
    max_time: float
    total: float


def _solve_capped(problem: _Problem, t_max: float, num_microbatches: int) -> _Answer | None:
    """Min-sum stages with every stage time <= ``t_max``; None if there are none."""
    capped = problem.best_time
    if math.isfinite(t_max):
        capped = {f: np.where(t <= t_max, t, np.inf) for f, t in problem.best_time.items()}
    costs = problem.per_stage_count(capped)
    tables = _run_dp(problem, costs, np.add)
    count, value = _best_stage_count(problem, tables)
    if not math.isfinite(value):
        return None
    path = _backtrack(problem, tables, costs, np.add, count)
    stages = tuple((k, e, j, problem.in_flight[count - i]) for i, (k, e, j) in enumerate(path))
    times = tuple(float(problem.best_time[f][k, e, j]) for k, e, j, f in stages)
    total = pipeline_time(times, num_microbatches)
    return _Answer(stages, times, float(sum(times)), max(times), total)


def _thin(caps_descending: np.ndarray, limit: int) -> tuple[np.ndarray, float]:
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


def _no_fit_error(
    problem: _Problem, num_hosts: int, per_host: int, options: StageDPOptions
) -> PlanError:
    """Why no stage assignment exists: missing candidates, or memory (with the least needed)."""
    tables = _run_dp(problem, problem.per_stage_count(problem.least_memory), np.maximum)
    _, need = _best_stage_count(problem, tables)
    where = f"{problem.num_layers} layers on {num_hosts} hosts x {per_host} devices"
    if options.num_stages is not None:
        where += f" in {options.num_stages} stages"
    if not math.isfinite(need):
        return PlanError(f"no stage partition of {where} has a candidate for every stage")
    budget = options.memory_budget_bytes
    return PlanError(
        f"no stage assignment of {where} fits in {budget:.0f} bytes "
        f"({budget / 2**30:.2f} GiB) per device: the smallest needs {need:.0f} bytes "
        f"({need / 2**30:.2f} GiB) per device (schedule {options.schedule}, "
        f"{options.num_microbatches} microbatches)"
    )


def _branch_and_bound(
    attempt: Callable[[float], _Answer],
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
            thinned, gap = _thin(open_caps[::-1], limit)
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


def solve_stages(
    table: StageCostTable, num_hosts: int, devices_per_host: int, options: StageDPOptions
) -> StagePartition:
    """The stages minimising ``sum(t_i) + (m - 1) * max(t_i)`` on all devices of the cluster.

    Raises PlanError (one line, with the numbers) when ``num_stages`` exceeds the layers or
    devices, or when no assignment fits (naming the least per-device memory one would need).
    """
    problem = _prepare(table, num_hosts, devices_per_host, options)
    m = options.num_microbatches
    # The smallest t_max for which any assignment exists: a min-max DP over the same table.
    bottleneck = _run_dp(problem, problem.per_stage_count(problem.best_time), np.maximum)
    _, t_low = _best_stage_count(problem, bottleneck)
    if not math.isfinite(t_low):
        raise _no_fit_error(problem, num_hosts, devices_per_host, options)

    answers: list[_Answer] = []

    def attempt(t_max: float) -> _Answer:
        answer = _solve_capped(problem, t_max, m)
        assert answer is not None, "t_max >= the smallest feasible cap always has an answer"
        answers.append(answer)
        return answer

    def best_total() -> float:
        return min(answer.total for answer in answers)

    unlimited = attempt(math.inf)
    if t_low < unlimited.max_time:
        attempt(t_low)  # often the winner when m is large; tightens the bounds below early
    # Every stage time the DP can pick is a cap worth trying; caps at or above the uncapped
    # answer's slowest stage return that answer again, caps at t_low or below were handled.
    distinct = np.unique(np.concatenate([t[np.isfinite(t)] for t in problem.best_time.values()]))
    caps = distinct[(distinct > t_low) & (distinct < unlimited.max_time)]
    gap = _branch_and_bound(
        attempt, best_total, caps, unlimited.stage_sum, m, options.max_tmax_candidates
    )
    best = min(answers, key=lambda a: a.total)
    stages = tuple(
        StageAssignment(
            start=k,
            end=e,
            submesh=table.submeshes[problem.table_index[j]],
            candidate=table.candidates(k, e, problem.table_index[j])[
                int(problem.best_index[f][k, e, j])
            ],
        )
        for k, e, j, f in best.stages
    )
    return StagePartition(
        stages=stages,
        num_microbatches=m,
        total_time=best.total,
        max_stage_time=best.max_time,
        exact=bool(gap == 0.0),
        tmax_relative_gap=float(gap),
        num_tmax_tried=len(answers),
    )


# ----------------------------------------------------------------------------- baselines


def _evaluate(
    table: StageCostTable,
    layer_ranges: Sequence[tuple[int, int]],
    shapes: Sequence[SubmeshShape],
    num_hosts: int,
    per_host: int,
    options: StageDPOptions,
    what: str,
) -> StagePartition:
    """The given stages, each run as its fastest candidate that fits the memory budget."""
    indices = [table.submesh_index(shape) for shape in shapes]
    place_submeshes(shapes, num_hosts, per_host)
    count, m = len(layer_ranges), options.num_microbatches
    stages = []
    for position, ((start, end), shape, index) in enumerate(
        zip(layer_ranges, shapes, indices, strict=True)
    ):
        in_flight = options.in_flight(count - position)
        found = table.candidates(start, end, index)
        fitting = [c for c in found if options.fits(c.memory(in_flight))]
        if not fitting:
            label = f"{what}: stage {position} (layers [{start}, {end}) on {shape})"
            if not found:
                raise PlanError(f"{label} has no candidate in the cost table")
            least = min(c.memory(in_flight) for c in found)
            raise PlanError(
                f"{label} needs at least {least:.0f} bytes per device with {in_flight} "
                f"microbatches in flight; the budget is {options.memory_budget_bytes:.0f}"
            )
        fastest = min(fitting, key=lambda c: c.time)
        stages.append(StageAssignment(start, end, shape, fastest))
    times = [stage.candidate.time for stage in stages]
    return StagePartition(
        stages=tuple(stages),
        num_microbatches=m,
        total_time=pipeline_time(times, m),
        max_stage_time=max(times),
        exact=True,
        num_tmax_tried=0,
    )


def uniform_stages(
    table: StageCostTable,
    num_stages: int,
    num_hosts: int,
    devices_per_host: int,
    options: StageDPOptions,
) -> StagePartition:
    """The baseline: ``num_stages`` stages of equal layer counts on equal submeshes.

    Only ``options``' microbatches, schedule and memory budget are used. PlanError (naming the
    numbers and the stage counts that do divide) when the layers or devices do not split.
    """
    layers, devices = table.num_layers, num_hosts * devices_per_host

    def shape_for(count: int) -> SubmeshShape | None:
        if layers % count or devices % count:
            return None
        width = devices // count
        shape = (
            SubmeshShape(1, width)
            if width <= devices_per_host
            else SubmeshShape(width // devices_per_host, devices_per_host)
        )
        ok = shape.num_devices == width and shape in table.submeshes
        return shape if ok and shape.fits(num_hosts, devices_per_host) else None

    valid = [c for c in range(1, min(layers, devices) + 1) if shape_for(c) is not None]
    shape = shape_for(num_stages) if 1 <= num_stages <= min(layers, devices) else None
    if shape is None:
        raise PlanError(
            f"uniform stages: {num_stages} stages do not split {layers} layers and {devices} "
            f"devices ({num_hosts} hosts x {devices_per_host}) evenly onto submeshes of the "
            f"table; choices: {choices_text(valid)}"
        )
    per = layers // num_stages
    ranges = [(i * per, (i + 1) * per) for i in range(num_stages)]
    return _evaluate(
        table, ranges, [shape] * num_stages, num_hosts, devices_per_host, options, "uniform stages"
    )


def manual_stages(
    table: StageCostTable,
    layer_ranges: Sequence[tuple[int, int]],
    submesh_shapes: Sequence[SubmeshShape],
    num_hosts: int,
    devices_per_host: int,
    options: StageDPOptions,
) -> StagePartition:
    """The user's stages, validated and evaluated on ``table`` like :func:`solve_stages`'s.

    The ranges must cover layers ``0..L-1`` contiguously, one submesh per range, and the
    submeshes must use exactly the cluster's devices; PlanError (one line) otherwise.
    """
    layers, devices = table.num_layers, num_hosts * devices_per_host
    ranges = [(int(start), int(end)) for start, end in layer_ranges]
    if len(ranges) != len(submesh_shapes) or not ranges:
        raise PlanError(
            f"manual stages: {len(ranges)} layer ranges but {len(submesh_shapes)} submeshes; "
            "give one submesh per range and at least one range"
        )
    expected_start = 0
    for start, end in ranges:
        if start != expected_start or end <= start:
            raise PlanError(
                f"manual stages: layer ranges {ranges} must be non-empty [start, end) pairs "
                f"covering 0..{layers - 1} in order; range [{start}, {end}) should start at "
                f"{expected_start}"
            )
        expected_start = end
    if expected_start != layers:
        raise PlanError(
            f"manual stages: layer ranges {ranges} end at layer {expected_start} but the model "
            f"has {layers} layers"
        )
    used = sum(shape.num_devices for shape in submesh_shapes)
    if used != devices:
        raise PlanError(
            f"manual stages: submeshes use {used} devices but the cluster has {devices} "
            f"({num_hosts} hosts x {devices_per_host})"
        )
    return _evaluate(
        table, ranges, submesh_shapes, num_hosts, devices_per_host, options, "manual stages"
    )
