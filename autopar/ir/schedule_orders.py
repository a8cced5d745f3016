"""Each pipeline schedule family's task order, and the per-stage facts counted from it.

:func:`make_schedule` builds a :class:`~autopar.ir.schedules.Schedule` from one builder per
family: GPipe, 1F1B (whose order the asynchronous schedules run too), zb-h1 and interleaved
1F1B. The compiler's stage memory reads the counts taken from the same lists, so they live
beside the builders: :func:`activation_counts` (microbatches in flight) and
:func:`weight_version_counts` (parameter versions alive, from the asynchronous schedules'
version rules :func:`version_read` and :func:`version_written`). Shared by compiler and
runtime like ``schedules``: it imports nothing from either half and no JAX.
"""

from __future__ import annotations

import functools

from autopar.ir.schedules import (
    ASYNC_SCHEDULES,
    Schedule,
    ScheduleName,
    Task,
    TaskKind,
    check_schedule_options,
    peak_in_flight,
    splits_backward,
)

# Each builder gives one stage's order as (kind, microbatch, chunk) steps: ``_build`` makes them
# the schedule's ``Task``s, and ``_activation_counts`` counts them as they are (the stage DP asks
# for every stage count up to its most: at 256 microbatches, 64 stage counts of 1F1B took 1.3 s
# as tasks, most of it making them).
Step = tuple[TaskKind, int, int]


def _gpipe(p: int, m: int, stage: int) -> list[Step]:
    # All forwards, then all backwards: every microbatch's activations are held at once.
    return [(TaskKind.F, i, 0) for i in range(m)] + [(TaskKind.B, i, 0) for i in range(m)]


def _one_f_one_b(p: int, m: int, stage: int) -> list[Step]:
    # PipeDream-flush: enough warm-up forwards to fill the pipe below this stage, then one
    # forward and one backward in turn, then drain the remaining backwards.
    warmup = min(p - stage - 1, m)
    steps: list[Step] = [(TaskKind.F, i, 0) for i in range(warmup)]
    for j in range(m - warmup):
        steps += [(TaskKind.F, warmup + j, 0), (TaskKind.B, j, 0)]
    steps += [(TaskKind.B, j, 0) for j in range(m - warmup, m)]
    return steps


def _zb_h1(p: int, m: int, stage: int) -> list[Step]:
    # 1F1B's F/B order, with W split off and held back by `stage` backwards: stage s keeps
    # p - s - 1 warm-up forwards + 1 + s delayed weight gradients = p microbatches until W, the
    # same peak as 1F1B's stage 0, and its delayed Ws fill the cool-down where 1F1B idles.
    warmup = min(p - stage - 1, m)
    w_delay = stage
    steps: list[Step] = [(TaskKind.F, i, 0) for i in range(warmup)]
    next_forward, next_w = warmup, 0
    for j in range(m):
        if next_forward < m:
            steps.append((TaskKind.F, next_forward, 0))
            next_forward += 1
        steps.append((TaskKind.B, j, 0))
        if j + 1 - next_w > w_delay:
            steps.append((TaskKind.W, next_w, 0))
            next_w += 1
    steps += [(TaskKind.W, i, 0) for i in range(next_w, m)]
    return steps


def _interleaved(p: int, m: int, v: int, stage: int) -> list[Step]:
    # Megatron-LM's interleaved 1F1B. Microbatches go through the chunks in groups of p: the k-th
    # forward of this stage is chunk (k // p) % v of microbatch (k // (p*v)) * p + k % p;
    # backwards walk the chunks in reverse. Warm-up covers the deeper stages' first round.
    total = m * v

    def forward(k: int) -> Step:
        group, within = divmod(k, p * v)
        return (TaskKind.F, group * p + within % p, within // p)

    def backward(k: int) -> Step:
        group, within = divmod(k, p * v)
        return (TaskKind.B, group * p + within % p, v - 1 - within // p)

    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    steps = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [forward(warmup + k), backward(k)]
    steps += [backward(k) for k in range(total - warmup, total)]
    return steps


def make_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> Schedule:
    """Build and validate the named schedule (a :class:`ScheduleName` or its string).

    Raises InvalidOptionError as :func:`check_schedule_options` does.
    """
    checked = check_schedule_options(name, num_stages, num_microbatches, num_chunks)
    return _validated(checked, num_stages, num_microbatches, num_chunks)


# A schedule is immutable and its validation walks every task's dependencies: the pipeline
# search estimates many partitions with the same stage and microbatch counts (GPT 1T on
# 3,072 GPUs: 14 estimates of 64 stages x 512 microbatches, each validated twice, took 13 s)
@functools.lru_cache(maxsize=16)
def _validated(name: ScheduleName, p: int, m: int, v: int) -> Schedule:
    schedule = _build(name, p, m, v)
    schedule.validate()
    return schedule


def _stage_steps(name: ScheduleName, p: int, m: int, v: int, stage: int) -> list[Step]:
    if name == ScheduleName.GPIPE:
        return _gpipe(p, m, stage)
    if name in (ScheduleName.ONE_F_ONE_B, *ASYNC_SCHEDULES):
        # asynchronous schedules run 1F1B's order; ``m`` microbatches in a row without a flush
        # in between is their steady state (the versions each task uses: ``async_schedules``)
        return _one_f_one_b(p, m, stage)
    if name == ScheduleName.ZB_H1:
        return _zb_h1(p, m, stage)
    return _interleaved(p, m, v, stage)


def _build(name: ScheduleName, p: int, m: int, v: int) -> Schedule:
    """The task lists of checked options, not yet validated (``make_schedule`` validates)."""
    return Schedule(name, p, m, v, tuple(
        tuple(Task(kind, microbatch, s, chunk) for kind, microbatch, chunk in
              _stage_steps(name, p, m, v, s)) for s in range(p)))


def activation_counts(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> tuple[float, ...]:
    """Per stage, how many microbatches' worth of that stage's activations it holds at peak.

    The one source of this fact for the compiler (stage DP, stage memory): the schedule's own
    task orders, counted as :meth:`Schedule.in_flight` counts them (``peak_in_flight``) until
    the task that frees a forward's stored values (W when the schedule splits the backward,
    since the weight gradient still reads them; else B), divided by ``num_chunks`` (an
    interleaved chunk holds ``1/v`` of the stage's layers). Fractional for interleaved
    schedules: p=4, m=8, v=2 gives (5.5, 4.5, 3.5, 2.5). Asynchronous schedules are counted in
    their steady state (calls back to back, no drain between them: ``p - i`` on stage ``i``
    whatever ``m``). Cached per (schedule, p, m, v); InvalidOptionError as
    :func:`make_schedule`. The orders are the ones :func:`make_schedule`'s tasks are made
    from, without its validation (a dependency walk that costs far more than the count, and
    that the schedule tests run on every builder).
    """
    name = check_schedule_options(name, num_stages, num_microbatches, num_chunks)
    return _activation_counts(name, num_stages, num_microbatches, num_chunks)


@functools.lru_cache(maxsize=4096)
def _activation_counts(
    name: ScheduleName, num_stages: int, num_microbatches: int, num_chunks: int
) -> tuple[float, ...]:
    m, v = num_microbatches, num_chunks
    if name in ASYNC_SCHEDULES:  # the pipeline is not drained between calls
        m, v = steady_microbatches(num_stages, num_microbatches), 1
    until = TaskKind.W if splits_backward(name) else TaskKind.B
    return tuple(peak_in_flight(_stage_steps(name, num_stages, m, v, stage), until) / num_chunks
                 for stage in range(num_stages))


def steady_microbatches(num_stages: int, num_microbatches: int) -> int:
    """How many microbatches (whole calls of ``num_microbatches``) an asynchronous schedule is
    simulated over to see its steady state: stage 0 holds up to ``p`` microbatches in flight,
    whose weight versions are ``p`` apart; ``3p`` and two calls more are past the fill."""
    return num_microbatches * (-(-3 * num_stages // num_microbatches) + 2)


def version_read(name: ScheduleName, num_stages: int, num_microbatches: int,
                 microbatch: int, stage: int) -> int:
    """The version of ``stage``'s weights that F and B of ``microbatch`` (numbered from the
    pipeline's start) read under an asynchronous schedule; version ``v``: after ``v`` updates.
    PipeDream: the newest when the forward runs, ``n - (p - 1 - i)``; 2BW: the previous call's,
    ``n // m - 1``; 0 while the pipeline fills. The backward reads what the forward read."""
    if name == ScheduleName.PIPEDREAM:
        return max(0, microbatch - (num_stages - 1 - stage))
    return max(0, microbatch // num_microbatches - 1)


def version_written(name: ScheduleName, num_microbatches: int, task: Task) -> int | None:
    """The version ``task`` writes by applying the update after it (None: it writes none):
    PipeDream after every backward, 2BW after the last backward of each call."""
    if task.kind is not TaskKind.B:
        return None
    n, m = task.microbatch, num_microbatches
    if name == ScheduleName.PIPEDREAM:
        return n + 1
    return n // m + 1 if n % m == m - 1 else None


def weight_version_counts(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> tuple[int, ...]:
    """Per stage, how many versions of that stage's parameters it holds at peak.

    The one source of this fact for the compiler (stage memory) and the runtime's check: 1 for
    the synchronous schedules; for the asynchronous ones, counted in their steady state from
    the versions their tasks read and write (:func:`version_read`, :func:`version_written`):
    PipeDream with weight stashing ``p - i`` on stage ``i``, PipeDream-2BW 2. Cached;
    InvalidOptionError as :func:`make_schedule`.
    """
    name = check_schedule_options(name, num_stages, num_microbatches, num_chunks)
    if name not in ASYNC_SCHEDULES:
        return (1,) * num_stages
    return _weight_version_counts(name, num_stages, num_microbatches)


@functools.lru_cache(maxsize=1024)
def _weight_version_counts(name: ScheduleName, p: int, m: int) -> tuple[int, ...]:
    schedule = _build(name, p, steady_microbatches(p, m), 1)
    return tuple(live_versions(name, schedule, stage, m) for stage in range(p))


def live_versions(name: ScheduleName, schedule: Schedule, stage: int,
                  num_microbatches: int) -> int:
    """Peak number of versions of ``stage``'s weights alive between its tasks in ``schedule``
    (an asynchronous schedule's lists, calls of ``num_microbatches`` back to back): the newest,
    those that microbatches in flight (F run, B not yet) read, and an older one the next
    forward still reads (2BW between its calls)."""
    p, m = schedule.num_stages, num_microbatches
    forwards = [t.microbatch for t in schedule.tasks[stage] if t.kind is TaskKind.F]
    latest, in_flight, next_forward, peak = 0, set(), 0, 0
    for task in schedule.tasks[stage]:
        if task.kind is TaskKind.F:
            in_flight.add(task.microbatch)
            next_forward += 1
        else:
            in_flight.discard(task.microbatch)
            written = version_written(name, m, task)
            latest = latest if written is None else written
        live = {latest} | {version_read(name, p, m, n, stage) for n in in_flight}
        if next_forward < len(forwards):
            upcoming = version_read(name, p, m, forwards[next_forward], stage)
            live |= {upcoming} if upcoming <= latest else set()
        peak = max(peak, len(live))
    return peak
