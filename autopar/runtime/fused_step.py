"""A one-stage pipelined step as one program: the driver traced once under ``jax.jit``.

With one stage nothing waits on another stage: every task's place in the order is fixed, so
calling each as its own program (a forward and a backward per microbatch, the microbatches'
slices, the accumulators' zeros, the loss's cotangent seed, the segments before and after the
pipeline, each dispatched and placed from Python) only adds the driver's cost to the step's.
Here the driver itself is traced under one ``jax.jit``: every task becomes part of one
program (the gradients accumulated in the program, the placements the stage plan's layouts
held with ``with_sharding_constraint``), and a step is one call, as a ShardParallel step of
the same stage is. On 8 simulated CPU devices, 4 microbatches, that measured 1.2x-5x faster
than the same plan task by task for every local zoo case (docs/pipeline.md), most where the
tasks are small and the driver's calls are most of the step; ``PipelineRunner(...,
fuse=False)`` keeps the tasks apart.

The first microbatch's tasks run in the schedule's order, and their gradients become the
accumulators. The microbatches after it run the same tasks as one ``lax.scan`` over their
slices, carrying the accumulators and the loss results' running sums, when every
microbatch runs the same tasks in the same order and each piece accumulates in microbatch
order (every one-stage schedule does; ``microbatch_tasks``). The sums are then the unrolled
driver's, in the same order, and the program holds one microbatch's tasks, not ``m``
copies. On 8 simulated CPU devices the loop ran GPT tiny's, MoE's and Wide-ResNet's steps
1.02x-1.09x faster than the unrolled program, and GPT small's 1.3x (1.6x on 2 devices).
``FusedStep(runner, loop=False)`` unrolls every microbatch.

The step's small results (``pipeline_state.shared_outputs``) go on every device of the
plan, which for one stage is the program's own mesh: the program itself places them there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autopar.ir.schedules import Schedule, Task, TaskKind
from autopar.runtime.pipeline_state import StepState, is_averaged
from autopar.runtime.program_calls import ProgramCall, TaskRecord, abstract_args


class FusedStep:
    """One step of a one-stage ``PipelineRunner`` as one jitted program."""

    # ``runner`` is the PipelineRunner it fuses, typed Any: runtime.pipeline imports this
    # module, and the architecture test counts even a type-checking import as a cycle
    def __init__(self, runner: Any, loop: bool = True) -> None:
        """``loop``: the microbatches after the first as one ``lax.scan`` where the schedule
        allows it (False: every microbatch's tasks unrolled into the program)."""
        self.runner = runner
        # the step's results it computes (the rest are constants of the traced step, which
        # the driver returns as they are)
        self.computed: list[int] = []
        # the first microbatch's tasks in the schedule's order, when the later microbatches
        # can run them as one loop (``microbatch_tasks``); None: the loop unrolled
        self.loop_tasks = (microbatch_tasks(runner.schedule) if loop and runner.m > 1
                           else None)
        self.program = jax.jit(self._step)

    def _step(self, flat_args: list[Any]) -> list[Any]:
        runner = self.runner
        st = runner.new_state(flat_args)
        if self.loop_tasks is None:
            runner.run_step(st)
        else:
            runner.begin_step(st)
            runner.end_step(st, self._run_microbatches(st, self.loop_tasks))
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
        args = self.on_mesh(flat_args)
        runner.records = []
        if calls is not None:
            calls.append(ProgramCall("step", 0, self.program, abstract_args((args,))))
        start = time.perf_counter()
        results = self.program(args)
        if record:
            jax.block_until_ready(results)
            runner.records = [TaskRecord("step", -1, 0, 0, 0.0, time.perf_counter() - start)]
        st = runner.new_state(args)
        st.env.update(zip(self.computed, results, strict=True))
        return [runner.output(st, v) for v in runner.pp.outer.out_ids]

    def on_mesh(self, flat_args: Sequence[Any]) -> list[Any]:
        """The step's inputs, each array committed to other devices (a state laid out by
        another plan, on another mesh or device set) put on the stage's mesh: a parameter in
        the layout the stage's plan reads it in, anything else replicated. One jitted program
        takes its devices from its inputs, so it cannot mix them; what lies on the mesh
        already (the step's own outputs fed back) or is uncommitted stays as it is."""
        runner = self.runner
        mesh = set(runner.meshes[0].devices.flat)
        args = list(flat_args)
        for k, (vid, value) in enumerate(zip(runner.pp.outer.in_ids, args, strict=True)):
            if (isinstance(value, jax.Array) and value.committed
                    and value.sharding.device_set != mesh):
                args[k] = runner.place(value, 0, runner.spec_source.get(vid))
        return args

    def _run_microbatches(self, st: StepState, tasks: tuple[Task, ...]) -> list[Any]:
        """Every microbatch's tasks: the first's on ``st``, the rest as one ``lax.scan`` over
        their slices, carrying each piece's gradient accumulators and the loss results'
        running sums (in their stages' layouts). Leaves the accumulators in ``st.accum`` and
        returns the loss results' sums over the microbatches."""
        runner = self.runner
        loss_ids = list(runner.pp.loss_outputs)

        def loss_parts(state: StepState) -> list[Any]:
            return [runner.place(state.acts[(fid, 0)], runner.loss_stage(k), fid)
                    for k, fid in enumerate(loss_ids)]

        for task in tasks:
            runner.run_task(st, task)
        first = loss_parts(st)
        split = sorted(runner.pp.split_inputs)
        slices = {fid: jnp.stack([st.acts[(fid, i)] for i in range(1, runner.m)])
                  for fid in split}
        pieces = sorted(st.accum)

        def one_microbatch(carry: Any, xs: dict[int, Any]) -> tuple[Any, None]:
            accum, sums = carry
            # the step's own values (parameters, placements) are the enclosing program's
            body = StepState(env=st.env, placed=dict(st.placed), copies=st.copies)
            body.acts = {(fid, 0): x for fid, x in xs.items()}
            body.accum = {p: list(a) for p, a in zip(pieces, accum, strict=True)}
            for task in tasks:
                runner.run_task(body, task)
            sums = [total + part if is_averaged(part) else part  # integers: the last's
                    for total, part in zip(sums, loss_parts(body), strict=True)]
            return ([body.accum[p] for p in pieces], sums), None

        (accum, sums), _ = jax.lax.scan(
            one_microbatch, ([st.accum[p] for p in pieces], first), slices)
        st.accum = dict(zip(pieces, accum, strict=True))
        # the means ``microbatch_mean`` takes, from the loop's sums (integers: the last's)
        return [(s / runner.m).astype(s.dtype) if is_averaged(s) else s for s in sums]


def microbatch_tasks(schedule: Schedule) -> tuple[Task, ...] | None:
    """The first microbatch's tasks in ``schedule``'s order, when every microbatch runs the
    same tasks in the same order and each piece's gradients are accumulated in microbatch
    order, so that a loop over the later microbatches computes what the schedule's order
    does; None otherwise."""
    order = schedule.global_order()
    per: dict[int, list[tuple[TaskKind, int, int]]] = {}
    for task in order:
        per.setdefault(task.microbatch, []).append((task.kind, task.stage, task.chunk))
    if any(tasks != per[0] for tasks in per.values()):
        return None
    accumulating = TaskKind.W if schedule.splits_backward else TaskKind.B
    seen: dict[int, int] = {}
    for task in order:
        if task.kind != accumulating:
            continue
        piece = task.piece(schedule.num_stages)
        if task.microbatch < seen.get(piece, -1):
            return None
        seen[piece] = task.microbatch
    return tuple(task for task in order if task.microbatch == 0)
