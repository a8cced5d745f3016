"""Asynchronous pipeline schedules as data: which weight version every task reads and writes.

Two schedules of the PipeDream family (``ScheduleName.PIPEDREAM``, ``PIPEDREAM_2BW``). Both
run 1F1B's task order on an endless stream of microbatches, numbered from the pipeline's
start; one call of the train step injects the next ``m`` of them and the pipeline is not
drained between calls (see docs/pipeline.md, "Asynchronous pipelines"). A stage's *version*
``v`` is its parameters after ``v`` of its updates (version 0: the weights the pipeline started
from).

- ``pipedream`` (PipeDream-1F1B with weight stashing): every microbatch is a minibatch; stage
  ``i`` applies the update rule after each backward, so B(n) writes version ``n + 1``. F(n)
  reads the newest version there is when it runs, ``n - (p - 1 - i)`` (clamped at 0 while the
  pipeline fills), and B(n) reads the same one (stashed), so both halves of a minibatch see
  one set of weights. Staleness on stage ``i``: ``p - 1 - i`` updates.
- ``pipedream-2bw`` (double-buffered weights): gradients are accumulated over a call's ``m``
  microbatches and each stage updates once per call, after its last backward of the call, so
  B(n) writes version ``n // m + 1`` when ``n`` ends a call. Every task of call ``t`` reads
  version ``t - 1`` (clamped at 0): ``W(t+1) = W(t) - lr * grad(W(t-1))``, staleness one
  update on every stage; needs ``m >= p - 1``.

A parameter read by pieces on several stages (a tied embedding) belongs to the first stage
that reads it (its gradient's home); every reader of microbatch ``n`` reads the version the
owner's F(n) read, so one microbatch sees one version of every weight.

Pure Python, no JAX: the runtime walks :meth:`WeightVersions.stage_task`; the version rules
themselves and the live-version counts the compiler reads are ``schedule_orders``' (the one
source of schedule facts): ``version_read``, ``version_written``, ``weight_version_counts``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import InvalidOptionError, PlanError, choices_text
from autopar.ir.schedule_orders import (
    live_versions,
    make_schedule,
    version_read,
    version_written,
)
from autopar.ir.schedules import (
    ASYNC_SCHEDULES,
    Schedule,
    ScheduleName,
    Task,
    TaskKind,
    check_schedule_options,
)


@dataclass(frozen=True)
class VersionUse:
    """The weight version a task reads, and the one it writes (None: it writes none)."""

    reads: int
    writes: int | None


@dataclass(frozen=True)
class WeightVersions:
    """The version rules of one asynchronous schedule on ``num_stages`` stages with
    ``num_microbatches`` microbatches per call (microbatches numbered from the pipeline's
    start)."""

    name: ScheduleName
    num_stages: int
    num_microbatches: int

    def __post_init__(self) -> None:
        name = check_schedule_options(self.name, self.num_stages, self.num_microbatches, 1)
        if name not in ASYNC_SCHEDULES:
            raise InvalidOptionError(
                f"schedule '{name}' is synchronous; weight versions are defined for "
                f"{choices_text(sorted(ASYNC_SCHEDULES))}"
            )
        object.__setattr__(self, "name", name)

    @property
    def per_microbatch(self) -> bool:
        """Whether each microbatch is its own update (PipeDream) rather than each call (2BW)."""
        return self.name == ScheduleName.PIPEDREAM

    def update_group(self, microbatch: int) -> int:
        """Which update a microbatch's gradient goes into (its gradients are summed with the
        other microbatches of the group): the microbatch itself, or its call."""
        return microbatch if self.per_microbatch else microbatch // self.num_microbatches

    def reads(self, microbatch: int, stage: int) -> int:
        """The version of ``stage``'s parameters that F and B of ``microbatch`` use there
        (``schedule_orders.version_read``)."""
        return version_read(self.name, self.num_stages, self.num_microbatches, microbatch,
                            stage)

    def writes(self, task: Task) -> int | None:
        """The version ``task`` creates on its stage by applying the update rule after it
        (``schedule_orders.version_written``)."""
        return version_written(self.name, self.num_microbatches, task)

    def use(self, task: Task) -> VersionUse:
        """What ``task`` reads and writes (both halves of a microbatch read the same version:
        weight stashing)."""
        return VersionUse(self.reads(task.microbatch, task.stage), self.writes(task))

    def staleness(self, stage: int) -> int:
        """How many updates of ``stage`` lie between the version a gradient is computed at and
        the version it is applied to, in the steady state: ``p - 1 - i`` (PipeDream), 1 (2BW);
        0 would be the synchronous step."""
        m = self.num_microbatches
        n = (3 * self.num_stages + 2) * m - 1  # ends a call, far past the fill
        written = self.writes(Task(TaskKind.B, n, stage))
        assert written is not None  # the last microbatch of a call writes under both
        return written - 1 - self.reads(n, stage)

    def stage_task(self, stage: int, k: int) -> Task:
        """The ``k``-th task of ``stage`` on the endless stream: 1F1B's order, ``p - 1 - i``
        warm-up forwards and then one forward and one backward in turn, never draining."""
        warmup = self.num_stages - 1 - stage
        if k < warmup:
            return Task(TaskKind.F, k, stage)
        j = k - warmup
        if j % 2 == 0:
            return Task(TaskKind.F, warmup + j // 2, stage)
        return Task(TaskKind.B, j // 2, stage)

    def task_index(self, task: Task) -> int:
        """Where ``task`` is in its stage's stream (the inverse of :meth:`stage_task`)."""
        warmup = self.num_stages - 1 - task.stage
        n = task.microbatch
        if task.kind is TaskKind.F:
            return n if n < warmup else warmup + 2 * (n - warmup)
        return warmup + 2 * n + 1

    def steady_state(self, num_calls: int) -> Schedule:
        """``num_calls`` calls back to back: 1F1B's lists over ``num_calls * m`` microbatches,
        filling once at the start and draining once at the end (no flush between calls)."""
        if num_calls < 1:
            raise InvalidOptionError(f"num_calls must be >= 1, got {num_calls}")
        return make_schedule(self.name, self.num_stages, num_calls * self.num_microbatches)

    def check(self, schedule: Schedule) -> None:
        """PlanError unless every version a task reads exists when it runs: written earlier in
        its stage's list (or 0), and not yet superseded by more than the stash keeps."""
        for stage, tasks in enumerate(schedule.tasks):
            latest = 0
            for task in tasks:
                use = self.use(task)
                if use.reads > latest:
                    raise PlanError(
                        f"schedule '{self.name}': {task} on stage {stage} reads version "
                        f"{use.reads} before it is written (newest: {latest})"
                    )
                if use.writes is not None:
                    if use.writes != latest + 1:
                        raise PlanError(f"schedule '{self.name}': {task} writes version "
                                        f"{use.writes} after version {latest}")
                    latest = use.writes

    def live_versions(self, schedule: Schedule, stage: int) -> int:
        """Peak number of versions of ``stage``'s parameters alive between its tasks in
        ``schedule`` (``schedule_orders.live_versions``)."""
        return live_versions(self.name, schedule, stage, self.num_microbatches)


def weight_versions(name: str, num_stages: int, num_microbatches: int) -> WeightVersions:
    """The version rules of ``name`` (InvalidOptionError naming the asynchronous schedules
    when it is not one of them, or as ``schedules.make_schedule``)."""
    # checked here as ``__post_init__`` checks it: the field holds the ScheduleName it names
    schedule = check_schedule_options(name, num_stages, num_microbatches, 1)
    return WeightVersions(schedule, num_stages, num_microbatches)
