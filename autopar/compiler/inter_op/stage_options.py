"""What the stage-construction search optimises for: microbatches, schedule, memory budget.

Shared by the search (:mod:`autopar.compiler.inter_op.stage_dp`) and its public entry points
(:mod:`autopar.compiler.inter_op.stages`, which re-exports everything here). Pure Python.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autopar.errors import InvalidOptionError, choices_text

__all__ = ["SCHEDULES", "StageDPOptions", "in_flight_microbatches"]

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
