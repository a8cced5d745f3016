"""A one-stage pipelined step as one program: the driver traced once under ``jax.jit``.

With one stage nothing waits on another stage: every task's place in the order is fixed, so
calling each as its own program (a forward and a backward per microbatch, the microbatches'
slices, the accumulators' zeros, the loss's cotangent seed, the segments before and after the
pipeline, each dispatched and placed from Python) only adds the driver's cost to the step's.
Here ``PipelineRunner.run_step`` itself is traced under one ``jax.jit``: every task becomes
part of one program (the microbatch loop unrolled in the schedule's order, the gradients
accumulated in the program, the placements the stage plan's layouts held with
``with_sharding_constraint``), and a step is one call, as a ShardParallel step of the same
stage is. The numbers are the driver's: the same microbatches, the same accumulation order.

The step's small results (``pipeline.shared_outputs``) go on every device of the plan, which
for one stage is the program's own mesh: the program itself places them there.

The default for one stage (``PipelineRunner(..., fuse=False)`` keeps the tasks apart): on 8
simulated CPU devices, 4 microbatches, it measured 1.2x-5x faster than the same plan task by
task for every local zoo case (docs/pipeline.md has the numbers), most where the tasks are
small and the driver's calls are most of the step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax

from autopar.runtime.program_calls import ProgramCall, TaskRecord, abstract_args


class FusedStep:
    """One step of a one-stage ``PipelineRunner`` as one jitted program."""

    # ``runner`` is the PipelineRunner it fuses, typed Any: runtime.pipeline imports this
    # module, and the architecture test counts even a type-checking import as a cycle
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        # the step's results it computes (the rest are constants of the traced step, which
        # the driver returns as they are)
        self.computed: list[int] = []
        self.program = jax.jit(self._step)

    def _step(self, flat_args: list[Any]) -> list[Any]:
        runner = self.runner
        st = runner.new_state(flat_args)
        runner.run_step(st)
        self.computed = [v for v in runner.pp.outer.out_ids if v in st.env]
        # one stage: "every device of the plan" is this program's mesh, so the small results
        # are placed there in the program rather than by a call per result after it (a
        # Wide-ResNet's batch statistics are a few dozen)
        return [jax.lax.with_sharding_constraint(st.env[v], runner.everywhere)
                if v in runner.shared_outputs else st.env[v] for v in self.computed]

    def __call__(self, flat_args: Sequence[Any], record: bool = False,
                 calls: list[ProgramCall] | None = None) -> list[Any]:
        """The step's flat outputs. ``record``: the program waited for and timed as the
        runner's one record (kind ``step``); ``calls``: the program logged (label ``step``)."""
        runner = self.runner
        args = list(flat_args)
        runner.records = []
        if calls is not None:
            calls.append(ProgramCall("step", 0, self.program, abstract_args((args,))))
        start = time.perf_counter()
        results = self.program(args)
        if record:
            jax.block_until_ready(results)
            runner.records = [TaskRecord("step", -1, 0, 0, 0.0, time.perf_counter() - start)]
        st = runner.new_state(flat_args)
        st.env.update(zip(self.computed, results, strict=True))
        return [runner.output(st, v) for v in runner.pp.outer.out_ids]
