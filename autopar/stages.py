"""The stages of a parallelized step, named as ``jax.stages`` names jit's: ``Traced`` (the
step traced for one input signature) -> ``Planned`` (its ``Plan``) -> ``Compiled`` (the plan
made runnable on the devices: a ``runtime.executables.StepExecutable``).

``step.trace(state, batch).plan().compile()`` is what a ``ParallelizedStep`` does on the first
call with a new input signature; each stage is also there for a user to stop at (inspect the
traced graph, read or save the plan, run the compiled step). Tracing and planning touch no
devices except the measured choice's timing, which the plan stage runs when the method asks
for it; compiling is where the runtime takes over.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax

from autopar.compiler.planners.status import PlanningStatus
from autopar.errors import InvalidOptionError, PlanError
from autopar.frontend.planning import (
    PlannedStep,
    StaticBinding,
    TracedTrainStep,
    bind_static_args,
    plan_traced,
    trace_train_step,
)
from autopar.frontend.progress import Progress
from autopar.frontend.static_leaves import array_leaves
from autopar.methods import AutoParallel, Method, PipeshardParallel, ReplicaMode
from autopar.plan import Plan
from autopar.runtime.distributed import global_devices, same_plan_everywhere
from autopar.runtime.executables import StepExecutable, build_executable
from autopar.runtime.local_cluster import local_cluster
from autopar.runtime.measured_choice import measured_chooser

if TYPE_CHECKING:
    from autopar.compiler.graph.opgraph import OpGraph
    from autopar.compiler.graph.trace import TracedStep

# seconds of planning before its progress line shows (on a terminal only)
PROGRESS_DELAY_S = 3.0


class StepSource(Protocol):
    """What the stages read of the step they stage (``autopar.ParallelizedStep``): its function,
    options and devices, and how it keys an input signature."""

    fn: Callable
    method: Method
    batch_argnums: tuple[int, ...]
    static_argnums: tuple[int, ...]
    donate_argnums: tuple[int, ...]
    devices: list[Any] | None
    cache: Any  # a frontend.plan_cache.PlanCache, or None
    saved_plan: Plan | None
    method_defaulted: bool

    def signature_key(self, args: Sequence[Any]) -> tuple: ...


def _abstract(leaf: Any) -> Any:
    """What a compiled step keeps of a flat input: its shape and dtype (a Python scalar as
    itself: it is traced weakly typed)."""
    if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                    weak_type=getattr(leaf, "weak_type", False))
    return leaf


@dataclass(frozen=True)
class Traced:
    """Stage 1: ``step`` traced for the input signature of the arguments it was given.
    ``traced_step`` is the traced program with its OpGraph (``graph``); ``plan()`` plans it."""

    step: StepSource
    key: tuple  # the input signature (the step's ``signature_key``)
    binding: StaticBinding
    traced_train_step: TracedTrainStep
    template: tuple[Any, ...]  # the flat inputs, abstract (arrays where given: measuring)
    donated: tuple[bool, ...]  # per flat input: whether the step may take its buffer
    devices: tuple[Any, ...]
    started: float  # when tracing began (``time.perf_counter``): the compile time's start

    @property
    def traced_step(self) -> TracedStep:
        """The traced program (``program``) and its OpGraph (``graph``)."""
        return self.traced_train_step.traced

    @property
    def graph(self) -> OpGraph:
        """The step's OpGraph: what the planner reads."""
        return self.traced_step.graph

    def plan(self) -> Planned:
        """Stage 2: the plan for the step's devices (the saved plan given to ``parallelize``,
        the on-disk cache's, or the planner's; with the measured choice's timing where the
        method asks for it). A planning longer than a few seconds shows its progress on a
        terminal."""
        step = self.step
        timed: dict[int, Any] = {}  # the measured choice's executables, by their plan's id
        choose = measured_chooser(_method_for_runtime(step), list(self.template),
                                  self.devices, self.donated, timed)
        status = PlanningStatus()
        with Progress(delay_s=PROGRESS_DELAY_S) as progress, \
                progress.phase("planning", detail=status.describe):
            planned = plan_traced(self.traced_train_step, local_cluster(step.devices),
                                  cache=step.cache, status=status, choose=choose)
        plan = same_plan_everywhere(planned.plan)  # across processes: process 0's plan
        _check_runnable(plan, len(self.devices))
        if plan is not planned.plan:
            planned = dataclasses.replace(planned, plan=plan)
        return Planned(self, planned, timed.get(id(plan)))


@dataclass(frozen=True)
class Planned:
    """Stage 2: a traced step's ``plan`` (a ``Plan``: plain data, saved with ``Plan.save``);
    ``compile()`` makes it runnable."""

    traced: Traced
    planned: PlannedStep
    executable: StepExecutable | None = None  # built by the measured choice: reused

    @property
    def plan(self) -> Plan:
        """The plan."""
        return self.planned.plan

    @property
    def from_cache(self) -> bool:
        """Whether the plan came from the on-disk cache."""
        return self.planned.from_cache

    def compile(self) -> Compiled:
        """Stage 3: the plan built on the step's devices (``runtime.build_executable``)."""
        t = self.traced
        executable = self.executable
        if executable is None:
            executable = build_executable(self.plan, self.planned.traced.program,
                                          self.planned.pipeline, t.devices, t.donated)
        return Compiled(t.step, t.key, self.planned.traced, self.plan, executable, t.binding,
                        tuple(_abstract(x) for x in t.template),
                        time.perf_counter() - t.started, self.from_cache)


@dataclass
class Compiled:
    """Stage 3: a plan made runnable. Call it as the step was called (same input signature)."""

    step: StepSource
    key: tuple
    traced: TracedStep
    plan: Plan
    executable: StepExecutable
    binding: StaticBinding  # maps a call's arguments to the executable's flat inputs and its
    # results back to the step's outputs
    avals: tuple[Any, ...]  # the flat inputs' shapes and dtypes
    compile_time_s: float  # trace, plan (or cache look-up) and building the executable
    from_cache: bool = False
    measured_idle_fraction: float | None = None

    def __call__(self, *args: Any) -> Any:
        """One step on ``args``, which must have the input signature this was compiled for."""
        if self.step.signature_key(args) != self.key:
            raise InvalidOptionError("these arguments' input signature (tree structure, shapes, "
                                     "dtypes, static values) is not the one this step was "
                                     "compiled for; call the parallelized step, which compiles "
                                     "each signature")
        return self.run(args)

    def flat_inputs(self, args: Sequence[Any]) -> list[Any]:
        """The executable's flat inputs for a call with ``args``."""
        return self.binding.array_inputs(args)

    def run(self, args: Sequence[Any], *, record: bool = False,
            flat: list[Any] | None = None) -> Any:
        """One step on ``args`` (not checked against the signature: the caller looked it up);
        ``record``: time every pipeline task; ``flat``: ``flat_inputs(args)`` where the caller
        has them already."""
        out = self.executable(self.flat_inputs(args) if flat is None else flat, record=record)
        # the static (non-array) output leaves recorded at trace time go back in
        return self.binding.outputs.restore(out, self.traced.program.out_tree)

    def as_text(self) -> str:
        """The compiled, optimized HLO text of a one-stage plan's sharded program."""
        return self.executable.hlo_text(list(self.avals))

    def input_shardings(self) -> list[jax.sharding.Sharding]:
        """Where the plan wants each flat input (``ParallelizedStep.input_shardings``)."""
        return self.executable.input_shardings(list(self.avals))


def trace(step: StepSource, args: Sequence[Any], key: tuple) -> Traced:
    """Stage 1 for ``step`` called with ``args`` (input signature ``key``)."""
    started = time.perf_counter()
    bound = bind_static_args(step.fn, args, step.static_argnums, step.batch_argnums)
    traced = trace_train_step(bound.fn, bound.dynamic_args, _method_for_runtime(step),
                              batch_argnums=bound.batch_argnums,
                              fall_back_to_shard=step.method_defaulted,
                              saved_plan=step.saved_plan)
    devices = tuple(step.devices if step.devices is not None else global_devices())
    donated = tuple(owner in step.donate_argnums for owner in bound.dynamic_argnums
                    for _ in array_leaves(args[owner]))
    return Traced(step, key, bound, traced, tuple(bound.array_inputs(args)), donated, devices,
                  started)


def _method_for_runtime(step: StepSource) -> Any:
    """The step's method as the runtime can run it: the pipeline runtime runs one replica, so
    a pipelined search plans these devices with none."""
    method = step.method
    if isinstance(method, AutoParallel | PipeshardParallel) and method.replicas == ReplicaMode.AUTO:
        return dataclasses.replace(method, replicas=ReplicaMode.NONE)
    return method


def _check_runnable(plan: Plan, num_devices: int) -> None:
    """A plan the runtime cannot run here is a one-line ``PlanError``."""
    if plan.pipeline is not None and plan.pipeline.replicas > 1:
        raise PlanError(
            f"the plan runs its pipeline as {plan.pipeline.replicas} data-parallel "
            "replicas on groups of hosts, which the pipeline runtime does not run yet (it "
            "runs one replica); plan for these devices, or with PipeshardParallel on one "
            "group of hosts")
    for i, stage in enumerate(plan.stages):
        beyond = [d for d in stage.device_ids if not 0 <= d < num_devices]
        if beyond:
            raise PlanError(f"plan field stages[{i}].device_ids names device {beyond[0]}; "
                            f"this step runs on {num_devices} device(s), ids 0 to "
                            f"{num_devices - 1}")
