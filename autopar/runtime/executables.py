"""The runtime's one entry from a plan to something that runs a step: one sharded program for
a one-stage plan, the pipeline driver for a pipelined one (the asynchronous driver for an
asynchronous schedule). Each takes the step's flat inputs and returns its flat outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar.ir.program import FlatProgram
from autopar.ir.schedules import is_async
from autopar.plan import Plan
from autopar.runtime.shard import ShardedProgram


def build_executable(plan: Plan, program: FlatProgram, pipeline: Any, devices: Sequence[Any],
                     donated: Sequence[bool] = ()) -> Any:
    """What runs ``plan``: a ``ShardedProgram`` of ``program`` (``donated``: per flat input,
    whether XLA may reuse its buffer), or for a pipelined plan the driver of ``pipeline``
    (an ``ir.pipeline_program.PipelineProgram``), which releases what it donates itself."""
    if pipeline is not None and plan.pipeline is not None and is_async(plan.pipeline.schedule):
        # the pipeline carries microbatches and weight versions from call to call
        from autopar.runtime.async_pipeline import AsyncPipelineRunner

        return AsyncPipelineRunner.from_plan(pipeline, plan, devices)
    if pipeline is not None:
        from autopar.runtime.pipeline import PipelineRunner

        return PipelineRunner.from_plan(pipeline, plan, devices)
    return ShardedProgram(program, plan, devices, donated=donated)
