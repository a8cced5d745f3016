"""The collectives a pipelined step emits: every program its driver runs in one step, counted in
its compiled HLO.

A pipelined step is no one program: each piece's forward and backward tasks, the segments
before and after the pipeline, the slicing of stacked inputs, the cut into microbatches and the
loss's mean over microbatches are jitted on their own and called as the schedule says (a
one-stage pipeline's step is one program, ``runtime.fused_step``: logged once, as ``step``).
``step_collectives`` runs one step with the driver logging each call (``PipelineRunner(...,
calls=...)``), compiles each distinct program once (its arguments' shapes, dtypes and
shardings as they were) and counts its collectives (``runtime.hlo``) as one call executes
them (a loop's body times its trip count), times the calls made with those arguments: a task
that runs once per microbatch counts m times, a segment once.
What is not a program is not counted: the moves between stages (``device_put``, no
collectives) and the driver's eager adding. Bytes follow the cost model's full-tensor
convention, so the totals stand beside the stage plans' predictions
(``StagePlan.collectives``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autopar.plan import CollectiveKind
from autopar.runtime.hlo import CollectiveSummary, count_collectives
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.program_calls import ProgramCall

__all__ = ["ProgramCollectives", "StepCollectives", "count_calls", "step_collectives"]


@dataclass(frozen=True)
class ProgramCollectives:
    """One distinct program of the step: its label (``F0``, ``B1``, ``segment2``, ...; see
    ``ProgramCall``), the stage it runs on (None: where the caller's input lies), how many
    times one step calls it, and the collectives of one call."""

    label: str
    stage: int | None
    calls: int
    summary: CollectiveSummary

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: per kind, the count and bytes of one call."""
        return {"label": self.label, "stage": self.stage, "calls": self.calls,
                "collectives": {k: v for k, v in self.summary.by_kind().items() if v["count"]}}


@dataclass(frozen=True)
class StepCollectives:
    """Every program of one pipelined step with its collectives (see the module)."""

    programs: tuple[ProgramCollectives, ...]
    num_stages: int

    def by_kind(self, stage: int | None = None) -> dict[str, dict[str, int]]:
        """Per collective kind, the count and bytes of one step (of ``stage``'s programs only,
        when given): each program's times its calls. Every kind is listed, as
        ``CollectiveSummary.by_kind`` lists them."""
        out = {k.value: {"count": 0, "bytes": 0} for k in CollectiveKind}
        for p in self.programs:
            if stage is not None and p.stage != stage:
                continue
            for kind, v in p.summary.by_kind().items():
                out[kind]["count"] += v["count"] * p.calls
                out[kind]["bytes"] += v["bytes"] * p.calls
        return out

    def by_stage(self) -> list[dict[str, dict[str, int]]]:
        """``by_kind`` of each stage, in stage order."""
        return [self.by_kind(s) for s in range(self.num_stages)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: the step's totals, per stage, and per program."""
        return {"total": self.by_kind(), "stages": self.by_stage(),
                "programs": [p.to_dict() for p in self.programs]}


def _key(call: ProgramCall) -> tuple:
    leaves, tree = jax.tree.flatten(call.args)
    return (id(call.fn), call.stage, str(tree),
            tuple(repr(x) if isinstance(x, jax.ShapeDtypeStruct) else repr(type(x))
                  for x in leaves))


def count_calls(calls: Sequence[ProgramCall], num_stages: int) -> StepCollectives:
    """Group logged calls into distinct programs (same function, stage and arguments' shapes,
    dtypes and shardings), compile each once and count its collectives."""
    groups: dict[tuple, list[ProgramCall]] = {}
    for call in calls:
        groups.setdefault(_key(call), []).append(call)
    programs = []
    for same in groups.values():
        first = same[0]
        text = first.fn.lower(*first.args).compile().as_text()
        # per run: a one-stage step's microbatches after the first are one loop
        # (``runtime.fused_step``) whose body's collectives run once per microbatch
        programs.append(ProgramCollectives(first.label, first.stage, len(same),
                                           count_collectives(text, per_run=True)))
    return StepCollectives(tuple(programs), num_stages)


def step_collectives(runner: PipelineRunner, flat_args: Sequence[Any]) -> StepCollectives:
    """Run one step of ``runner`` on ``flat_args`` (its results are dropped) and count the
    collectives of every program it ran (see the module). Every process of a multi-process
    run must call it, as it calls the step."""
    calls: list[ProgramCall] = []
    jax.block_until_ready(runner(flat_args, calls=calls))
    return count_calls(calls, len(runner.meshes))
