"""What the stage-construction search optimises for: microbatches, schedule, memory budget.

Shared by the search (:mod:`autopar.compiler.inter_op.stage_dp`) and its public entry points
(:mod:`autopar.compiler.inter_op.stages`, which re-exports everything here). Pure Python.

How many microbatches' activations a stage holds is the schedule's own fact
(:func:`autopar.ir.schedule_orders.activation_counts`, from its task lists): the options only
ask it.
Under GPipe and 1F1B the count depends on the stage's position from the last stage alone; under
ZB-H1 and interleaved 1F1B on the total stage count too, which is why the search may have to
run once per stage count (:meth:`StageDPOptions.counts_by_stages_from_end`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autopar.errors import InvalidOptionError, PlanError, choices_text
from autopar.ir.schedule_orders import activation_counts, weight_version_counts
from autopar.ir.schedules import (
    ScheduleName,
    check_schedule_options,
    is_async,
    schedule_name,
)

__all__ = ["StageDPOptions"]


@dataclass(frozen=True)
class StageDPOptions:
    """What the stage DP optimises for.

    ``schedule`` is a :class:`~autopar.ir.schedules.ScheduleName` (or its string) and
    ``num_chunks`` its model chunks per stage (``>= 2`` for interleaved 1F1B, else 1).
    ``memory_budget_bytes`` is per device (None: unlimited). ``num_stages`` fixes the stage
    count (None: any). ``max_tmax_candidates`` bounds the DP runs of the exact search; past it,
    the caps still to visit are thinned with a relative gap (at most that many again) and the
    result is reported as not exact.
    """

    num_microbatches: int = 1
    schedule: str = ScheduleName.ONE_F_ONE_B
    memory_budget_bytes: float | None = None
    num_stages: int | None = None
    max_tmax_candidates: int = 512
    num_chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("num_microbatches", "max_tmax_candidates", "num_chunks"):
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
        schedule = schedule_name(self.schedule)
        if schedule is None:
            raise InvalidOptionError(
                f"unknown pipeline schedule {self.schedule!r}; choices: "
                f"{choices_text(ScheduleName)}"
            )
        object.__setattr__(self, "schedule", schedule)
        # the chunk count the schedule takes (one stage divides every microbatch count)
        check_schedule_options(schedule, 1, self.num_microbatches, self.num_chunks)

    def activation_counts(self, num_stages: int) -> tuple[float, ...]:
        """Per stage of a ``num_stages``-stage pipeline, the microbatches' worth of its
        activations it holds at peak (the schedule's simulated count; InvalidOptionError when
        the schedule does not run on that many stages, e.g. interleaved with ``m % p != 0``)."""
        return activation_counts(
            self.schedule, num_stages, self.num_microbatches, self.num_chunks
        )

    def in_flight(self, stage: int, num_stages: int) -> float:
        """In-flight microbatches of stage ``stage`` (0-based) of a ``num_stages``-stage
        pipeline."""
        return self.activation_counts(num_stages)[stage]

    def weight_versions(self, stage: int, num_stages: int) -> int:
        """Versions of its parameters stage ``stage`` of ``num_stages`` holds at peak (the
        schedule's count, ``weight_version_counts``: 1 unless the schedule is asynchronous)."""
        return weight_version_counts(self.schedule, num_stages, self.num_microbatches,
                                     self.num_chunks)[stage]

    def weight_versions_by_count(self, max_stages: int) -> dict[float, int]:
        """The weight versions a stage holds, by its in-flight count, over pipelines of 1 to
        ``max_stages`` stages (the stage DP sizes stages by that count alone; empty when every
        stage holds one version). PlanError if one count came with two version counts."""
        if not is_async(self.schedule):
            return {}
        found: dict[float, int] = {}
        for p in range(1, max_stages + 1):
            if not self.valid_stage_count(p):
                continue
            counts = zip(self.activation_counts(p), weight_version_counts(
                self.schedule, p, self.num_microbatches, self.num_chunks), strict=True)
            for f, versions in counts:
                if found.setdefault(f, versions) != versions:
                    raise PlanError(f"schedule '{self.schedule}' holds {found[f]} and "
                                    f"{versions} weight versions with {f:g} microbatches in "
                                    "flight; the stage DP sizes stages by that count alone")
        return found

    def valid_stage_count(self, num_stages: int) -> bool:
        """Whether the schedule runs on ``num_stages`` stages with these microbatches/chunks."""
        try:
            check_schedule_options(
                self.schedule, num_stages, self.num_microbatches, self.num_chunks
            )
        except InvalidOptionError:
            return False
        return True

    def counts_by_stages_from_end(self, max_stages: int) -> tuple[float, ...] | None:
        """``counts[s]``, the in-flight count of the stage ``s`` stages from the end (itself
        included; ``counts[0]`` unused), when it is the same in every pipeline of 1 to
        ``max_stages`` stages; None when it depends on the stage count (or some count of
        stages is not valid for the schedule). Decided by comparing the simulated counts."""
        if not all(self.valid_stage_count(p) for p in range(1, max_stages + 1)):
            return None
        longest = self.activation_counts(max_stages)
        by_end = (0.0, *reversed(longest))  # by_end[s]: s stages from the end
        for p in range(1, max_stages):
            counts = self.activation_counts(p)
            if any(counts[p - s] != by_end[s] for s in range(1, p + 1)):
                return None
        return by_end

    def fits(self, memory_bytes: float) -> bool:
        """Whether ``memory_bytes`` per device is within the budget."""
        return self.memory_budget_bytes is None or memory_bytes <= self.memory_budget_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "num_microbatches": self.num_microbatches,
            "schedule": str(self.schedule),
            "memory_budget_bytes": self.memory_budget_bytes,
            "num_stages": self.num_stages,
            "max_tmax_candidates": self.max_tmax_candidates,
            "num_chunks": self.num_chunks,
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
