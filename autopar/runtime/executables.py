"""The runtime's one entry from a plan to something that runs a step: ``build_executable``
gives a ``StepExecutable``, which runs the step's flat inputs to its flat outputs on one of three
runners (one sharded program for a one-stage plan, the pipeline driver for a pipelined one, the
asynchronous driver for an asynchronous schedule) and owns what jax.jit's donation would do:
the buffers of donated inputs are released after the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from autopar.errors import InvalidOptionError
from autopar.ir.program import FlatProgram
from autopar.ir.schedules import is_async
from autopar.plan import Plan
from autopar.runtime.shard import ShardedProgram

if TYPE_CHECKING:
    from autopar.runtime.async_pipeline import AsyncPipelineRunner
    from autopar.runtime.pipeline import PipelineRunner
    from autopar.runtime.pipeline_hlo import StepCollectives

    Runner = ShardedProgram | PipelineRunner | AsyncPipelineRunner


@dataclass
class StepExecutable:
    """A plan made runnable: ``runner`` runs one step; ``donated`` says, per flat input,
    whether the step may take its buffer (the one-stage program donates it to XLA; the
    pipeline drivers cannot donate in place, so what a call did not hand back, or does not
    keep for later calls, is deleted after it)."""

    runner: Runner
    donated: tuple[bool, ...] = ()

    @property
    def pipelined(self) -> bool:
        """Whether the step runs as a pipeline of stage programs (not one sharded program)."""
        return not isinstance(self.runner, ShardedProgram)

    def __call__(self, flat: Sequence[Any], *, record: bool = False) -> list[Any]:
        """One step: the flat outputs for the flat inputs ``flat``. ``record`` (pipelined
        steps only): wait for and time every task (``records``)."""
        runner = self.runner
        if isinstance(runner, ShardedProgram):
            if record:
                raise InvalidOptionError("recording times pipeline tasks; this step is one "
                                         "sharded program")
            out = runner(flat)
        else:
            out = runner(flat, record=record)
        self._release_donated(flat, out)
        return out

    @property
    def records(self) -> list[Any]:
        """The task records (stage, kind, microbatch, start, end) of the last recorded call
        of a pipelined step ([] for one program)."""
        return list(getattr(self.runner, "records", []))

    def place(self, flat: Sequence[Any]) -> list[Any]:
        """``flat`` where the one-stage program wants it (a pipeline's driver places each
        stage's inputs itself: unchanged)."""
        if isinstance(self.runner, ShardedProgram):
            return self.runner.place(flat)
        return list(flat)

    def program(self) -> ShardedProgram:
        """The one sharded program a one-stage plan runs (``InvalidOptionError`` for a
        pipelined one, which compiles one program per stage task)."""
        if not isinstance(self.runner, ShardedProgram):
            raise InvalidOptionError(
                "a pipelined step compiles one program per stage task, not one sharded "
                "program (see its plan's stages, or pipeline_collectives)")
        return self.runner

    def hlo_text(self, flat: Sequence[Any]) -> str:
        """The compiled, optimized HLO text of the one-stage program for inputs like
        ``flat``."""
        return self.program().hlo_text(flat)

    def input_shardings(self, flat: Sequence[Any]) -> list[jax.sharding.Sharding]:
        """Where the step wants each flat input (``runtime.input_layouts``)."""
        from autopar.runtime.input_layouts import input_shardings

        return input_shardings(self.runner, flat)

    def collectives(self, flat: Sequence[Any]) -> StepCollectives:
        """A pipelined step's collectives per program and stage, from one step run on ``flat``
        (``runtime.pipeline_hlo.step_collectives``)."""
        from autopar.runtime.pipeline import PipelineRunner
        from autopar.runtime.pipeline_hlo import step_collectives

        if not isinstance(self.runner, PipelineRunner):
            raise InvalidOptionError("pipeline_collectives counts a pipelined step's programs; "
                                     "this step is one program (see get_hlo_collectives)")
        return step_collectives(self.runner, flat)

    def _release_donated(self, flat: Sequence[Any], outputs: Sequence[Any]) -> None:
        """Free the buffers of donated inputs that the step did not hand back and does not
        keep (an asynchronous pipeline's weight versions: microbatches in flight may still
        read a donated input)."""
        if not any(self.donated):
            return
        held = getattr(self.runner, "held_arrays", None)
        kept = {id(o) for o in outputs} | {id(x) for x in (held() if held is not None else ())}
        for leaf, give in zip(flat, self.donated, strict=True):
            if give and isinstance(leaf, jax.Array) and id(leaf) not in kept \
                    and not leaf.is_deleted():
                leaf.delete()


def build_executable(plan: Plan, program: FlatProgram, pipeline: Any, devices: Sequence[Any],
                     donated: Sequence[bool] = ()) -> StepExecutable:
    """What runs ``plan``: a ``ShardedProgram`` of ``program``, or for a pipelined plan the
    driver of ``pipeline`` (an ``ir.pipeline_program.PipelineProgram``; the asynchronous
    driver for an asynchronous schedule). ``donated``: per flat input, whether the step may
    take its buffer."""
    runner: Runner
    if pipeline is not None and plan.pipeline is not None and is_async(plan.pipeline.schedule):
        # the pipeline carries microbatches and weight versions from call to call
        from autopar.runtime.async_pipeline import AsyncPipelineRunner

        runner = AsyncPipelineRunner.from_plan(pipeline, plan, devices)
    elif pipeline is not None:
        from autopar.runtime.pipeline import PipelineRunner

        runner = PipelineRunner.from_plan(pipeline, plan, devices)
    else:
        runner = ShardedProgram(program, plan, devices, donated=donated)
    return StepExecutable(runner, tuple(donated))
