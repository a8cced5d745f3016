"""What the planner is doing, for a progress display to read: the planners write it, nothing
in the planner reads it. One per planning (``StepProgram.status``); the frontend's progress
line shows it (``autopar compile`` on a terminal: ``tracing and planning (14.2 s, pipelines:
312 ILPs solved, 96 of 140 in this batch)``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlanningStatus:
    """The phase (a candidate's name, ``pipelines``), the ILPs solved so far, and how many
    the batch now being solved holds (``batch_size``; 0 while ILPs are solved as asked)."""

    phase: str = "tracing"
    ilps_solved: int = 0
    batch_size: int = 0
    batch_solved: int = 0

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.batch_size = self.batch_solved = 0

    def expect(self, count: int) -> None:
        """A batch of ``count`` ILPs is about to be solved (the layer costs' prefetch)."""
        self.batch_size, self.batch_solved = count, 0

    def solved(self, count: int = 1) -> None:
        self.ilps_solved += count
        if self.batch_size:
            self.batch_solved = min(self.batch_size, self.batch_solved + count)

    def describe(self) -> str:
        """``pipelines: 312 ILPs solved, 96 of 140 in this batch``."""
        text = f"{self.phase}: {self.ilps_solved} ILPs solved"
        if self.batch_size:
            text += f", {self.batch_solved} of {self.batch_size} in this batch"
        return text
