"""Pipeline schedules as pure data (their simulation and swimlanes: ``schedule_timeline.py``).

A schedule says, for every physical pipeline stage (device group), which tasks it runs and in
which order: forwards (F), backwards (B) and, for the zero-bubble schedule, the weight-gradient
half of the backward (W). The compiler reads schedules for stage memory (microbatches in flight:
:func:`activation_counts`, the only place that fact is computed) and the estimated idle
fraction; the runtime driver walks the task lists. Both sides share this
module, so it imports nothing from ``compiler/`` or ``runtime/`` and no JAX.

With ``v`` chunks per stage (interleaved 1F1B) the model is cut into ``p * v`` pieces and chunk
``c`` of stage ``s`` runs piece ``c * p + s`` (Megatron-LM's interleaved mapping).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from autopar.errors import InvalidOptionError, PlanError, choices_text


class ScheduleName(StrEnum):
    """The pipeline schedules; members equal their strings (``ScheduleName.ZB_H1 == "zb-h1"``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZB_H1 = "zb-h1"
    # asynchronous: parameters change between microbatches (see ``async_schedules.py``)
    PIPEDREAM = "pipedream"
    PIPEDREAM_2BW = "pipedream-2bw"


ASYNC_SCHEDULES = frozenset({ScheduleName.PIPEDREAM, ScheduleName.PIPEDREAM_2BW})


def is_async(name: Any) -> bool:
    """Whether ``name`` is an asynchronous schedule (the training algorithm changes with it:
    weight updates happen while other microbatches are in flight)."""
    return schedule_name(name) in ASYNC_SCHEDULES


def schedule_name(name: Any) -> ScheduleName | None:
    """``name`` as a :class:`ScheduleName`, or None when it names no schedule."""
    try:
        return ScheduleName(name)
    except ValueError:
        return None


class TaskKind(StrEnum):
    """What a task computes."""

    F = "F"  # forward
    B = "B"  # backward; in zb-h1 only the input-gradient part
    W = "W"  # weight-gradient part of the backward (zb-h1 only)


@dataclass(frozen=True, order=True)
class Task:
    """One unit of pipeline work: ``kind`` of ``microbatch`` on chunk ``chunk`` of ``stage``."""

    kind: TaskKind
    microbatch: int
    stage: int
    chunk: int = 0

    def piece(self, num_stages: int) -> int:
        """The model piece (virtual stage) this task runs."""
        return self.chunk * num_stages + self.stage

    @property
    def label(self) -> str:
        """Short label for drawings: ``F3``, ``B0``, ``W2``; ``F3.1`` when the chunk is not 0."""
        text = f"{self.kind.value}{self.microbatch}"
        return f"{text}.{self.chunk}" if self.chunk else text


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered task lists: ``m`` microbatches through ``p`` stages of ``v`` chunks."""

    name: ScheduleName
    num_stages: int
    num_microbatches: int
    num_chunks: int
    tasks: tuple[tuple[Task, ...], ...]

    @property
    def num_pieces(self) -> int:
        """How many pieces the model is cut into (``p * v``)."""
        return self.num_stages * self.num_chunks

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into B (input gradient) and W (weight gradient)."""
        return self.name == ScheduleName.ZB_H1

    def task_at(self, kind: TaskKind, microbatch: int, piece: int) -> Task:
        """The task of ``kind`` on ``microbatch`` that runs model piece ``piece``."""
        chunk, stage = divmod(piece, self.num_stages)
        return Task(kind, microbatch, stage, chunk)

    def dependencies(self, task: Task) -> tuple[Task, ...]:
        """Tasks that must finish before ``task`` may start (on any stage)."""
        piece = task.piece(self.num_stages)
        i = task.microbatch
        if task.kind is TaskKind.F:
            return (self.task_at(TaskKind.F, i, piece - 1),) if piece > 0 else ()
        if task.kind is TaskKind.B:
            own_forward = self.task_at(TaskKind.F, i, piece)
            if piece == self.num_pieces - 1:
                return (own_forward,)
            return (self.task_at(TaskKind.B, i, piece + 1), own_forward)
        return (self.task_at(TaskKind.B, i, piece),)

    def expected_tasks(self) -> set[Task]:
        """Every task the schedule must contain exactly once."""
        kinds = (TaskKind.F, TaskKind.B) + ((TaskKind.W,) if self.splits_backward else ())
        return {
            self.task_at(kind, i, piece)
            for kind in kinds
            for i in range(self.num_microbatches)
            for piece in range(self.num_pieces)
        }

    def validate(self) -> None:
        """Raise PlanError unless each task runs once, in a dependency-respecting runnable order."""
        if len(self.tasks) != self.num_stages:
            raise PlanError(
                f"schedule '{self.name}' has {len(self.tasks)} task lists for "
                f"{self.num_stages} stages"
            )
        seen: set[Task] = set()
        for stage, stage_tasks in enumerate(self.tasks):
            for task in stage_tasks:
                if task.stage != stage:
                    raise PlanError(f"task {task} is listed on stage {stage}")
                if task in seen:
                    raise PlanError(f"task {task} appears twice in schedule '{self.name}'")
                seen.add(task)
        expected = self.expected_tasks()
        if seen != expected:
            missing, extra = sorted(expected - seen), sorted(seen - expected)
            raise PlanError(
                f"schedule '{self.name}' misses {len(missing)} tasks (first {missing[:1]}) and "
                f"has {len(extra)} unexpected (first {extra[:1]})"
            )
        for stage_tasks in self.tasks:
            position = {task: k for k, task in enumerate(stage_tasks)}
            for k, task in enumerate(stage_tasks):
                for dep in self.dependencies(task):
                    if dep.stage == task.stage and position[dep] > k:
                        raise PlanError(f"on stage {task.stage}, {task} comes before {dep}")
        self.global_order()  # raises on deadlock

    def global_order(self) -> tuple[Task, ...]:
        """One order of all tasks that respects every dependency and every stage's list order.

        Raises PlanError when none exists (the stages would wait on each other forever).
        """
        next_index = [0] * self.num_stages
        done: set[Task] = set()
        order: list[Task] = []
        progress = True
        while progress:
            progress = False
            for stage, stage_tasks in enumerate(self.tasks):
                # Run as far as this stage can go before looking at the next stage.
                while next_index[stage] < len(stage_tasks):
                    task = stage_tasks[next_index[stage]]
                    if not all(dep in done for dep in self.dependencies(task)):
                        break
                    done.add(task)
                    order.append(task)
                    next_index[stage] += 1
                    progress = True
        if len(order) != sum(len(t) for t in self.tasks):
            blocked = [
                str(t[next_index[s]]) for s, t in enumerate(self.tasks) if next_index[s] < len(t)
            ]
            raise PlanError(
                f"schedule '{self.name}' deadlocks: stages wait on {', '.join(blocked)}"
            )
        return tuple(order)

    def in_flight(self, stage: int, until: TaskKind = TaskKind.B) -> int:
        """Peak number of (microbatch, piece) pairs on ``stage`` whose F ran and ``until`` not yet.

        With the default ``until=B`` this is the activation count that sizes stage memory (as in
        the 1F1B and zero-bubble papers); ``until=W`` counts zb-h1 microbatches until their
        weight gradient, which still reads the stored layer inputs.
        """
        if not 0 <= stage < self.num_stages:
            raise InvalidOptionError(
                f"stage {stage} is out of range: valid stages are 0..{self.num_stages - 1}"
            )
        open_pairs: set[tuple[int, int]] = set()
        peak = 0
        for task in self.tasks[stage]:
            pair = (task.microbatch, task.chunk)
            if task.kind is TaskKind.F:
                open_pairs.add(pair)
                peak = max(peak, len(open_pairs))
            elif task.kind is until:
                open_pairs.discard(pair)
        return peak

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; tasks are ``[kind, microbatch, chunk]`` in each stage's list."""
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "num_chunks": self.num_chunks,
            "tasks": [[[t.kind.value, t.microbatch, t.chunk] for t in ts] for ts in self.tasks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """Inverse of :meth:`to_dict`; validates the result (PlanError when malformed)."""
        try:
            tasks = tuple(
                tuple(
                    Task(TaskKind(kind), int(microbatch), stage, int(chunk))
                    for kind, microbatch, chunk in stage_tasks
                )
                for stage, stage_tasks in enumerate(data["tasks"])
            )
            schedule = cls(
                name=ScheduleName(data["name"]),
                num_stages=int(data["num_stages"]),
                num_microbatches=int(data["num_microbatches"]),
                num_chunks=int(data["num_chunks"]),
                tasks=tasks,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed schedule dict: {exc!r}") from None
        schedule.validate()
        return schedule


def check_schedule_options(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int
) -> ScheduleName:
    """``name`` as a :class:`ScheduleName` when the schedule takes these counts.

    InvalidOptionError (one line, naming the valid choices) for an unknown name,
    ``num_stages < 1``, ``num_microbatches < 1``, or a chunk count the schedule does not take
    (interleaved: ``>= 2`` and ``m % p == 0``; others: 1).
    """
    found = schedule_name(name)
    if found is None:
        raise InvalidOptionError(
            f"unknown pipeline schedule {name!r}: choose one of {choices_text(ScheduleName)}"
        )
    if num_stages < 1:
        raise InvalidOptionError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise InvalidOptionError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if found == ScheduleName.INTERLEAVED_1F1B:
        if num_chunks < 2:
            raise InvalidOptionError(
                f"interleaved-1f1b needs num_chunks >= 2, got {num_chunks} "
                f"(use 1f1b for one chunk per stage)"
            )
        if num_microbatches % num_stages:
            raise InvalidOptionError(
                f"interleaved-1f1b needs num_microbatches (m={num_microbatches}) divisible by "
                f"num_stages (p={num_stages})"
            )
    elif found == ScheduleName.PIPEDREAM_2BW and num_microbatches < num_stages - 1:
        # the next batch's first forward on stage 0 must find the version its previous batch's
        # last backward writes (``async_schedules``): m >= p - 1
        raise InvalidOptionError(
            f"pipedream-2bw needs num_microbatches >= num_stages - 1 (m={num_microbatches}, "
            f"p={num_stages}): with fewer, more than two weight versions would be live"
        )
    if found != ScheduleName.INTERLEAVED_1F1B and num_chunks != 1:
        raise InvalidOptionError(
            f"schedule '{found}' runs one chunk per stage, got num_chunks={num_chunks}: "
            f"valid is 1 (only interleaved-1f1b takes num_chunks >= 2)"
        )
    return found


def _gpipe(p: int, m: int, stage: int) -> list[Task]:
    # All forwards, then all backwards: every microbatch's activations are held at once.
    return [Task(TaskKind.F, i, stage) for i in range(m)] + [
        Task(TaskKind.B, i, stage) for i in range(m)
    ]


def _one_f_one_b(p: int, m: int, stage: int) -> list[Task]:
    # PipeDream-flush: enough warm-up forwards to fill the pipe below this stage, then one
    # forward and one backward in turn, then drain the remaining backwards.
    warmup = min(p - stage - 1, m)
    tasks = [Task(TaskKind.F, i, stage) for i in range(warmup)]
    for j in range(m - warmup):
        tasks += [Task(TaskKind.F, warmup + j, stage), Task(TaskKind.B, j, stage)]
    tasks += [Task(TaskKind.B, j, stage) for j in range(m - warmup, m)]
    return tasks


def _zb_h1(p: int, m: int, stage: int) -> list[Task]:
    # 1F1B's F/B order, with W split off and held back by `stage` backwards: stage s keeps
    # p - s - 1 warm-up forwards + 1 + s delayed weight gradients = p microbatches until W, the
    # same peak as 1F1B's stage 0, and its delayed Ws fill the cool-down where 1F1B idles.
    warmup = min(p - stage - 1, m)
    w_delay = stage
    tasks = [Task(TaskKind.F, i, stage) for i in range(warmup)]
    next_forward, next_w = warmup, 0
    for j in range(m):
        if next_forward < m:
            tasks.append(Task(TaskKind.F, next_forward, stage))
            next_forward += 1
        tasks.append(Task(TaskKind.B, j, stage))
        if j + 1 - next_w > w_delay:
            tasks.append(Task(TaskKind.W, next_w, stage))
            next_w += 1
    tasks += [Task(TaskKind.W, i, stage) for i in range(next_w, m)]
    return tasks


def _interleaved(p: int, m: int, v: int, stage: int) -> list[Task]:
    # Megatron-LM's interleaved 1F1B. Microbatches go through the chunks in groups of p: the k-th
    # forward of this stage is chunk (k // p) % v of microbatch (k // (p*v)) * p + k % p;
    # backwards walk the chunks in reverse. Warm-up covers the deeper stages' first round.
    total = m * v

    def forward(k: int) -> Task:
        group, within = divmod(k, p * v)
        return Task(TaskKind.F, group * p + within % p, stage, within // p)

    def backward(k: int) -> Task:
        group, within = divmod(k, p * v)
        return Task(TaskKind.B, group * p + within % p, stage, v - 1 - within // p)

    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    tasks = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        tasks += [forward(warmup + k), backward(k)]
    tasks += [backward(k) for k in range(total - warmup, total)]
    return tasks


def make_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> Schedule:
    """Build and validate the named schedule (a :class:`ScheduleName` or its string).

    Raises InvalidOptionError as :func:`check_schedule_options` does.
    """
    schedule = _build(
        check_schedule_options(name, num_stages, num_microbatches, num_chunks),
        num_stages,
        num_microbatches,
        num_chunks,
    )
    schedule.validate()
    return schedule


def _build(name: ScheduleName, p: int, m: int, v: int) -> Schedule:
    """The task lists of checked options, not yet validated (``make_schedule`` validates)."""
    if name == ScheduleName.GPIPE:
        lists = [_gpipe(p, m, s) for s in range(p)]
    elif name in (ScheduleName.ONE_F_ONE_B, *ASYNC_SCHEDULES):
        # asynchronous schedules run 1F1B's order; ``m`` microbatches in a row without a flush
        # in between is their steady state (the versions each task uses: ``async_schedules``)
        lists = [_one_f_one_b(p, m, s) for s in range(p)]
    elif name == ScheduleName.ZB_H1:
        lists = [_zb_h1(p, m, s) for s in range(p)]
    else:
        lists = [_interleaved(p, m, v, s) for s in range(p)]
    return Schedule(name, p, m, v, tuple(tuple(ts) for ts in lists))


def activation_counts(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> tuple[float, ...]:
    """Per stage, how many microbatches' worth of that stage's activations it holds at peak.

    The one source of this fact for the compiler (stage DP, stage memory): the schedule's own
    task lists, :meth:`Schedule.in_flight` counted until the task that frees a forward's stored
    values (W when the schedule splits the backward, since the weight gradient still reads
    them; else B), divided by ``num_chunks`` (an interleaved chunk holds ``1/v`` of the stage's
    layers). Fractional for interleaved schedules: p=4, m=8, v=2 gives (5.5, 4.5, 3.5, 2.5).
    Asynchronous schedules are counted in their steady state (calls back to back, no drain
    between them: ``p - i`` on stage ``i`` whatever ``m``). Cached per (schedule, p, m, v);
    InvalidOptionError as :func:`make_schedule`. The lists are
    the ones :func:`make_schedule` returns, without its validation (a dependency walk that
    costs far more than the count, and that the schedule tests run on every builder).
    """
    name = check_schedule_options(name, num_stages, num_microbatches, num_chunks)
    return _activation_counts(name, num_stages, num_microbatches, num_chunks)


@functools.lru_cache(maxsize=4096)
def _activation_counts(
    name: ScheduleName, num_stages: int, num_microbatches: int, num_chunks: int
) -> tuple[float, ...]:
    if name in ASYNC_SCHEDULES:  # the pipeline is not drained between calls
        schedule = _build(name, num_stages, steady_microbatches(num_stages, num_microbatches), 1)
    else:
        schedule = _build(name, num_stages, num_microbatches, num_chunks)
    until = TaskKind.W if schedule.splits_backward else TaskKind.B
    return tuple(
        schedule.in_flight(stage, until=until) / num_chunks for stage in range(num_stages)
    )


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
