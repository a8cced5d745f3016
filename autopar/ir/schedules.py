"""Pipeline schedules as pure data: their names, tasks, per-stage task lists and checks (each
family's task order and the per-stage counts taken from it: ``schedule_orders.py``; their
simulation and swimlanes: ``schedule_timeline.py``).

A schedule says, for every physical pipeline stage (device group), which tasks it runs and in
which order: forwards (F), backwards (B) and, for the zero-bubble schedule, the weight-gradient
half of the backward (W). The compiler reads schedules for stage memory (microbatches in flight:
:func:`~autopar.ir.schedule_orders.activation_counts`, the only place that fact is computed) and
the estimated idle fraction; the runtime driver walks the task lists. Both sides share this
module, so it imports nothing from ``compiler/`` or ``runtime/`` and no JAX.

With ``v`` chunks per stage (interleaved 1F1B) the model is cut into ``p * v`` pieces and chunk
``c`` of stage ``s`` runs piece ``c * p + s`` (Megatron-LM's interleaved mapping).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
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


def _needs(kind: TaskKind, microbatch: int, piece: int, last_piece: int
           ) -> tuple[tuple[TaskKind, int, int], ...]:
    """The (kind, microbatch, piece) of each task that must finish before this one starts: a
    forward after the previous piece's, a backward after its own forward and the next
    piece's backward, a weight gradient after its own backward."""
    if kind is TaskKind.F:
        return ((TaskKind.F, microbatch, piece - 1),) if piece > 0 else ()
    if kind is TaskKind.B:
        own_forward = (TaskKind.F, microbatch, piece)
        if piece == last_piece:
            return (own_forward,)
        return ((TaskKind.B, microbatch, piece + 1), own_forward)
    return ((TaskKind.B, microbatch, piece),)


def splits_backward(name: ScheduleName) -> bool:
    """Whether schedule ``name`` splits backwards into B (input gradient) and W (weight
    gradient)."""
    return name == ScheduleName.ZB_H1


def peak_in_flight(steps: Iterable[tuple[TaskKind, int, int]], until: TaskKind) -> int:
    """Peak number of (microbatch, chunk) pairs whose F ran and ``until`` not yet, over one
    stage's ``(kind, microbatch, chunk)`` steps in order (``Schedule.in_flight``)."""
    open_pairs: set[tuple[int, int]] = set()
    peak = 0
    for kind, microbatch, chunk in steps:
        if kind is TaskKind.F:
            open_pairs.add((microbatch, chunk))
            if len(open_pairs) > peak:
                peak = len(open_pairs)
        elif kind is until:
            open_pairs.discard((microbatch, chunk))
    return peak


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
        return splits_backward(self.name)

    def task_at(self, kind: TaskKind, microbatch: int, piece: int) -> Task:
        """The task of ``kind`` on ``microbatch`` that runs model piece ``piece``."""
        chunk, stage = divmod(piece, self.num_stages)
        return Task(kind, microbatch, stage, chunk)

    def dependencies(self, task: Task) -> tuple[Task, ...]:
        """Tasks that must finish before ``task`` may start (on any stage)."""
        needed = _needs(task.kind, task.microbatch, task.piece(self.num_stages),
                        self.num_pieces - 1)
        return tuple(self.task_at(*key) for key in needed)

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
        # distinct tasks, each of a kind, microbatch and piece the schedule has, are all of
        # them when they are as many (the full comparison, and the dependency walk below, run
        # only to say what is wrong: a 64-stage, 512-microbatch schedule has 98,304 tasks)
        kinds = {TaskKind.F, TaskKind.B} | ({TaskKind.W} if self.splits_backward else set())
        valid = all(t.kind in kinds and 0 <= t.microbatch < self.num_microbatches
                    and 0 <= t.chunk < self.num_chunks for t in seen)
        if not valid or len(seen) != len(kinds) * self.num_microbatches * self.num_pieces:
            expected = self.expected_tasks()
            missing, extra = sorted(expected - seen), sorted(seen - expected)
            raise PlanError(
                f"schedule '{self.name}' misses {len(missing)} tasks (first {missing[:1]}) and "
                f"has {len(extra)} unexpected (first {extra[:1]})"
            )
        try:
            self.global_order()
        except PlanError:
            # a task listed after one of its own stage that needs it deadlocks too: name it
            for stage_tasks in self.tasks:
                position = {task: k for k, task in enumerate(stage_tasks)}
                for k, task in enumerate(stage_tasks):
                    for dep in self.dependencies(task):
                        if dep.stage == task.stage and position[dep] > k:
                            raise PlanError(
                                f"on stage {task.stage}, {task} comes before {dep}") from None
            raise

    def global_order(self) -> tuple[Task, ...]:
        """One order of all tasks that respects every dependency and every stage's list order.

        Raises PlanError when none exists (the stages would wait on each other forever).
        """
        return self._global_order

    @functools.cached_property
    def _global_order(self) -> tuple[Task, ...]:
        # computed once: the schedule is immutable (a frozen dataclass without slots keeps
        # the cached value in its instance dict)
        next_index = [0] * self.num_stages
        # done tasks as (kind, microbatch, piece): the dependencies of ``dependencies``
        # without making a Task for each (the pipeline search orders schedules of 10^5 tasks)
        done: set[tuple[TaskKind, int, int]] = set()
        order: list[Task] = []
        p, last = self.num_stages, self.num_pieces - 1
        progress = True
        while progress:
            progress = False
            for stage, stage_tasks in enumerate(self.tasks):
                # Run as far as this stage can go before looking at the next stage.
                while next_index[stage] < len(stage_tasks):
                    task = stage_tasks[next_index[stage]]
                    key = (task.kind, task.microbatch, task.chunk * p + stage)
                    if not all(dep in done for dep in _needs(*key, last)):
                        break
                    done.add(key)
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
        return peak_in_flight(((t.kind, t.microbatch, t.chunk) for t in self.tasks[stage]), until)

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
