"""A schedule's timeline: event simulation under task costs, and the text swimlane.

Shared like ``schedules.py`` (pure Python, no JAX): the compiler simulates estimated stage
times for the report and the stage plan's idle fraction; ``swimlane.py`` draws the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from autopar.errors import InvalidOptionError
from autopar.ir.schedule_orders import make_schedule
from autopar.ir.schedules import (
    Schedule,
    ScheduleName,
    Task,
    TaskKind,
    is_async,
)


def default_cost(schedule: Schedule) -> Callable[[Task], float]:
    """Unit costs: F = B (= W in zb-h1) = 1 per stage's work, i.e. 1/v per interleaved chunk."""
    per_task = 1.0 / schedule.num_chunks
    return lambda task: per_task


@dataclass(frozen=True)
class Timeline:
    """Start and end time of every task of a simulated schedule."""

    schedule: Schedule
    spans: Mapping[Task, tuple[float, float]]
    _busy: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        busy = [0.0] * self.schedule.num_stages
        for task, (start, end) in self.spans.items():
            busy[task.stage] += end - start
        object.__setattr__(self, "_busy", tuple(busy))

    @property
    def makespan(self) -> float:
        """Time from the first task's start (0) to the last task's end."""
        return max((end for _, end in self.spans.values()), default=0.0)

    def busy(self, stage: int) -> float:
        """Total time ``stage`` spends running tasks."""
        return self._busy[stage]

    @property
    def idle_fraction(self) -> float:
        """Share of all stages' time spent idle: ``1 - total busy / (p * makespan)``."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self._busy) / (self.schedule.num_stages * span)

    @property
    def theoretical_idle_fraction(self) -> float:
        """The papers' idle fraction for this schedule under its default unit costs.

        GPipe and 1F1B: (p-1)/(m+p-1). Interleaved: the bubble shrinks to (p-1)/v of a stage's
        F+B, giving (p-1)/(v*m+p-1). ZB-H1 (F=B=W): bubble (p-1)(T_F+T_B-T_W) = p-1 against 3m
        of work, giving (p-1)/(3m+p-1).
        """
        p, m, v = (
            self.schedule.num_stages,
            self.schedule.num_microbatches,
            self.schedule.num_chunks,
        )
        if self.schedule.name == ScheduleName.INTERLEAVED_1F1B:
            return (p - 1) / (v * m + p - 1)
        if self.schedule.name == ScheduleName.ZB_H1:
            return (p - 1) / (3 * m + p - 1)
        if is_async(self.schedule.name):  # the pipeline fills once, not once per step
            return 0.0
        return (p - 1) / (m + p - 1)


def simulate(schedule: Schedule, cost: Callable[[Task], float] | None = None) -> Timeline:
    """Run the schedule on an idealised machine: each stage runs its list in order, and a task
    starts as soon as its stage is free and all its dependencies (on any stage) have finished.
    Transfers are free. ``cost(task)`` gives durations (default: :func:`default_cost`).
    """
    cost = cost or default_cost(schedule)
    spans: dict[Task, tuple[float, float]] = {}
    stage_free = [0.0] * schedule.num_stages
    # Start times are a max-plus function of predecessors, so any dependency-respecting order of
    # evaluation gives the same timeline.
    for task in schedule.global_order():
        duration = float(cost(task))
        if duration < 0:
            raise InvalidOptionError(f"task cost must be >= 0, got {duration} for {task}")
        ready = max((spans[dep][1] for dep in schedule.dependencies(task)), default=0.0)
        start = max(ready, stage_free[task.stage])
        spans[task] = (start, start + duration)
        stage_free[task.stage] = start + duration
    return Timeline(schedule, spans)


def stage_timeline(
    name: str,
    stage_times: Sequence[float],
    num_microbatches: int,
    num_chunks: int = 1,
) -> Timeline:
    """The schedule simulated for stages whose forward + backward of one microbatch takes
    ``stage_times[s]``: a piece's forward is a third of its share, its backward two thirds
    (input and weight gradients a third each when the schedule splits them)."""
    p = len(stage_times)
    schedule = make_schedule(name, p, num_microbatches, num_chunks)
    per_piece = [t / num_chunks for t in stage_times]

    def cost(task: Task) -> float:
        t = per_piece[task.stage]
        if task.kind == TaskKind.F or schedule.splits_backward:
            return t / 3
        return 2 * t / 3

    return simulate(schedule, cost)


@dataclass(frozen=True)
class SteadyState:
    """An asynchronous schedule's calls back to back: the timeline of ``num_calls`` calls (the
    fill at the start, no drain between calls), and the time and idle fraction per call once
    the pipeline is full."""

    timeline: Timeline
    num_calls: int
    call_s: float
    idle_fraction: float


def steady_state(
    name: str,
    stage_times: Sequence[float],
    num_microbatches: int,
    update_times: Sequence[float] | None = None,
    num_calls: int = 3,
) -> SteadyState:
    """An asynchronous schedule simulated as :func:`stage_timeline` simulates one step, with
    ``update_times[s]`` added to each backward after which stage ``s`` applies its update (the
    schedule's data: every backward under PipeDream, the last of each call under 2BW). The
    time per call is the difference between ``n`` and ``n + 2`` calls past the fill, halved."""
    # imported here: async_schedules builds on schedules, which this module's callers import
    from autopar.ir.async_schedules import weight_versions

    p, m = len(stage_times), num_microbatches
    versions = weight_versions(name, p, m)
    updates = list(update_times) if update_times is not None else [0.0] * p

    def cost(task: Task) -> float:
        t = stage_times[task.stage]
        if task.kind is TaskKind.F:
            return t / 3
        written = versions.writes(task)
        return 2 * t / 3 + (updates[task.stage] if written is not None else 0.0)

    def span(calls: int) -> float:
        return simulate(versions.steady_state(calls), cost).makespan

    filled = -(-2 * p // m) + 1
    call_s = (span(filled + 2) - span(filled)) / 2
    writes_per_call = m if versions.per_microbatch else 1
    busy = sum(m * t + writes_per_call * u for t, u in zip(stage_times, updates, strict=True))
    idle = 1.0 - busy / (p * call_s) if call_s > 0 else 0.0
    timeline = simulate(versions.steady_state(num_calls), cost)
    return SteadyState(timeline, num_calls, call_s, max(0.0, idle))


def render_text(timeline: Timeline, width: int | None = None) -> str:
    """Swimlane as text: one row per stage, one column per time slot, ``.`` where idle.

    The slot length is the shortest task duration; a task longer than one slot shows its label
    and then ``-`` in the following slots. Rows longer than ``width`` characters (default 120)
    wrap into blocks, each headed by its time range.
    """
    schedule = timeline.schedule
    durations = [end - start for start, end in timeline.spans.values() if end > start]
    if not durations:
        return "\n".join(f"stage {s} |" for s in range(schedule.num_stages))
    slot = min(durations)
    num_slots = max(1, round(timeline.makespan / slot))
    cell = max(len(task.label) for task in timeline.spans) + 1
    grid = [["." for _ in range(num_slots)] for _ in range(schedule.num_stages)]
    for task, (start, end) in timeline.spans.items():
        first, last = round(start / slot), max(round(end / slot), round(start / slot) + 1)
        for k in range(first, min(last, num_slots)):
            grid[task.stage][k] = task.label if k == first else "-"
    prefix_len = len(f"stage {schedule.num_stages - 1} | ")
    per_block = max(1, ((width or 120) - prefix_len) // cell)
    blocks = []
    for lo in range(0, num_slots, per_block):
        hi = min(lo + per_block, num_slots)
        lines = [f"t = {lo * slot:g} .. {hi * slot:g}"] if num_slots > per_block else []
        for stage, row in enumerate(grid):
            cells = "".join(label.ljust(cell) for label in row[lo:hi]).rstrip()
            lines.append(f"stage {stage}".ljust(prefix_len - 3) + " | " + cells)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
