"""``autopar.parallelize``: the decorator that traces, plans and runs a train step.

The first call with a new input signature (pytree structure, shapes, dtypes) traces the step,
plans it for the local devices and compiles it; later calls with the same signature reuse that.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from autopar.compiler.mesh import ClusterSpec, load_cluster
from autopar.compiler.plan import Plan
from autopar.compiler.planner import plan_step
from autopar.compiler.trace import TracedStep, trace_step
from autopar.errors import (
    BatchSizeError,
    InvalidOptionError,
    MeshError,
    NoLossFunctionError,
    PlanError,
)
from autopar.methods import METHOD_TYPES, Method, PipeshardParallel, ShardParallel
from autopar.runtime.shard import ShardedProgram


def local_cluster(devices: Sequence[Any] | None = None) -> ClusterSpec:
    """A description of ``devices`` (default: all this process sees) as one host."""
    devices = list(jax.devices() if devices is None else devices)
    base = load_cluster("cpu-sim")
    return ClusterSpec.from_dict(
        base.to_dict() | {"name": f"local-{devices[0].platform}"}
    ).with_devices(1, len(devices))


@dataclass
class CompiledStep:
    """Everything made for one input signature: the trace, the plan, the executable."""

    traced: TracedStep
    plan: Plan
    executable: Any  # ShardedProgram, or a PipelineRunner for pipelined steps
    compile_time_s: float


def _signature_key(args: Sequence[Any]) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tuple(args))
    parts = []
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            parts.append((tuple(np.shape(leaf)), str(leaf.dtype)))
        else:
            parts.append(("static", repr(leaf)))
    return (treedef, tuple(parts))


class ParallelizedStep:
    """A train step wrapped by :func:`parallelize`: call it like the original."""

    def __init__(
        self,
        fn: Callable,
        method: Method,
        batch_argnums: tuple[int, ...],
        devices: Sequence[Any] | None = None,
        plan: Plan | None = None,
    ):
        if not callable(fn):
            raise InvalidOptionError(f"parallelize needs a function, got {type(fn).__name__}")
        if not isinstance(method, METHOD_TYPES):
            raise InvalidOptionError(
                f"method={method!r} is not a parallelization method; valid methods: "
                + ", ".join(f"autopar.{t.__name__}()" for t in METHOD_TYPES)
            )
        if any(not isinstance(i, int) or i < 0 for i in batch_argnums):
            raise InvalidOptionError(
                f"batch_argnums={tuple(batch_argnums)!r} must be non-negative argument indices"
            )
        self.fn = fn
        self.method = method
        self.batch_argnums = tuple(batch_argnums)
        self.devices = None if devices is None else list(devices)
        self._cache: dict[tuple, CompiledStep] = {}
        self.saved_plan = plan  # run this plan instead of planning (checked against each trace)
        self.method_defaulted = False  # parallelize() without method=: the full search
        functools.update_wrapper(self, fn)

    def _compiled(self, args: Sequence[Any]) -> CompiledStep:
        if any(i >= len(args) for i in self.batch_argnums):
            raise InvalidOptionError(
                f"batch_argnums={self.batch_argnums} names argument {max(self.batch_argnums)} "
                f"but the step was called with {len(args)} argument(s)"
            )
        key = _signature_key(args)
        found = self._cache.get(key)
        if found is None:
            start = time.perf_counter()
            if self.saved_plan is not None:
                traced, plan, executable = self._from_saved_plan(args)
            elif isinstance(self.method, PipeshardParallel):
                traced, plan, executable = self._pipeline(args)
            else:
                traced = trace_step(self.fn, args)
                plan = plan_step(
                    traced, self.method, local_cluster(self.devices),
                    batch_argnums=self.batch_argnums,
                )
                executable = ShardedProgram(traced.program, plan, self.devices)
            found = CompiledStep(traced, plan, executable, time.perf_counter() - start)
            if self.saved_plan is None:  # a saved plan stays as it was loaded
                plan.options["compile_time_s"] = found.compile_time_s
            self._cache[key] = found
        return found

    def _from_saved_plan(self, args: Sequence[Any]) -> tuple[TracedStep, Plan, Any]:
        plan = self.saved_plan
        devices = self.devices if self.devices is not None else jax.devices()
        used = max((d for st in plan.stages for d in st.device_ids), default=-1) + 1
        if used > len(devices):
            raise MeshError(f"the plan uses {used} devices but this step has {len(devices)}")
        if plan.method == "pipeshard":
            from autopar.compiler.trace import build_graph
            from autopar.pipeline_program import build_pipeline_program
            from autopar.runtime.pipeline import PipelineRunner

            pp = build_pipeline_program(self.fn, args, self.batch_argnums, plan.num_microbatches)
            traced = TracedStep(pp.outer, build_graph(pp.outer))
            _check_signature(plan, traced)
            return traced, plan, PipelineRunner.from_plan(pp, plan, devices)
        traced = trace_step(self.fn, args)
        _check_signature(plan, traced)
        return traced, plan, ShardedProgram(traced.program, plan, self.devices)

    def _pipeline(self, args: Sequence[Any]) -> tuple[TracedStep, Plan, Any]:
        # imported here: the pipeline stack loads only when a pipelined step is planned
        from autopar.compiler.pipeshard import plan_pipeshard
        from autopar.compiler.trace import build_graph
        from autopar.pipeline_program import build_pipeline_program
        from autopar.runtime.pipeline import PipelineRunner

        method = self.method
        try:
            pp = build_pipeline_program(self.fn, args, self.batch_argnums, method.num_microbatches)
        except (NoLossFunctionError, BatchSizeError) as err:
            if not self.method_defaulted:
                raise
            # the default search needs a marked loss and a batch the microbatches divide;
            # without them one stage (the intra-operator pass alone) is what it can do
            traced = trace_step(self.fn, args)
            plan = plan_step(traced, ShardParallel(), local_cluster(self.devices),
                             batch_argnums=self.batch_argnums)
            plan.notes.append(f"one stage, no pipeline: {err}")
            return traced, plan, ShardedProgram(traced.program, plan, self.devices)
        plan = plan_pipeshard(pp, method, local_cluster(self.devices))
        plan.batch_argnums = self.batch_argnums
        devices = self.devices if self.devices is not None else jax.devices()
        runner = PipelineRunner.from_plan(pp, plan, devices)
        return TracedStep(pp.outer, build_graph(pp.outer)), plan, runner

    def __call__(self, *args: Any) -> Any:
        compiled = self._compiled(args)
        flat = jax.tree_util.tree_leaves(tuple(args))
        out = compiled.executable(flat)
        return jax.tree_util.tree_unflatten(compiled.traced.program.out_tree, out)

    def timed_call(self, *args: Any) -> tuple[Any, list[Any]]:
        """Run one step of a pipelined step with every task waited for and timed; returns the
        outputs and the task records (stage, kind, microbatch, start, end), and stores the
        measured idle fraction in the plan (``options["measured_idle_fraction"]``)."""
        compiled = self._compiled(args)
        runner = compiled.executable
        if not hasattr(runner, "records"):
            raise InvalidOptionError("timed_call times pipeline tasks; this step is not "
                                     f"pipelined (method {compiled.plan.method})")
        from autopar.runtime.pipeline import measured_idle_fraction

        out = runner(jax.tree_util.tree_leaves(tuple(args)), record=True)
        records = list(runner.records)
        compiled.plan.options["measured_idle_fraction"] = measured_idle_fraction(
            records, len(compiled.plan.stages))
        return jax.tree_util.tree_unflatten(compiled.traced.program.out_tree, out), records

    def get_plan(self, *args: Any) -> Plan:
        """The plan for these arguments (arrays or ``jax.ShapeDtypeStruct``)."""
        return self._compiled(args).plan

    def get_hlo_text(self, *args: Any) -> str:
        """The compiled, optimized HLO text of the sharded program for these arguments."""
        compiled = self._compiled(args)
        if not isinstance(compiled.executable, ShardedProgram):
            raise InvalidOptionError(
                "get_hlo_text covers one sharded program; a pipelined step compiles one "
                "program per stage task (see get_plan for its stages)"
            )
        return compiled.executable.hlo_text(jax.tree_util.tree_leaves(tuple(args)))

    def get_traced(self, *args: Any) -> TracedStep:
        """The traced program and its OpGraph for these arguments."""
        return self._compiled(args).traced


def _check_signature(plan: Plan, traced: TracedStep) -> None:
    """A saved plan names tensors of one trace: the step's inputs must be the plan's."""
    graph = traced.graph
    have = [(io.path, graph.tensors[io.tensor].shape, graph.tensors[io.tensor].dtype)
            for io in graph.inputs]
    want = [(s.path, tuple(s.shape), s.dtype) for s in plan.signature]
    if have == want:
        return
    if len(have) != len(want):
        raise PlanError(f"the plan does not match this step: it was made for {len(want)} input "
                        f"leaves, the step has {len(have)}")
    (hp, hs, hd), (wp, ws, wd) = next((h, w) for h, w in zip(have, want, strict=True) if h != w)
    raise PlanError(f"the plan does not match this step: input {hp!r} is {hd}{list(hs)} here "
                    f"but the plan has {wp!r} as {wd}{list(ws)}")


def parallelize(
    fn: Callable | None = None,
    *,
    method: Method | None = None,
    batch_argnums: Sequence[int] = (1,),
    devices: Sequence[Any] | None = None,
    plan: Plan | str | os.PathLike | None = None,
) -> Any:
    """Parallelize a train step over the local devices.

    ``step = autopar.parallelize(train_step, method=autopar.DataParallel())``; usable bare
    (``@autopar.parallelize``) or with arguments. ``batch_argnums`` names the positional
    arguments that hold the batch (split by data parallelism); the rest is state.
    ``devices`` restricts the step to these devices (default: all of this process's).
    Without ``method`` the full automatic search runs (``PipeshardParallel()``: stages,
    submeshes and intra-operator plans, one stage when that is best); a step that does not
    differentiate with ``autopar.value_and_grad`` / ``autopar.grad`` gets one stage planned by
    the intra-operator pass (``ShardParallel()``), with a note in the plan.
    ``plan``: a saved ``Plan`` (or the path of one, from ``Plan.save``) to run without planning;
    each new input signature is checked against it (a one-line ``PlanError`` when it does not
    match).
    """
    saved = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
    if saved is not None and not isinstance(saved, Plan):
        raise InvalidOptionError(f"plan= takes an autopar.Plan or a path to a saved plan, got "
                                 f"{type(saved).__name__}")
    if saved is not None and method is not None and method.name != saved.method:
        raise InvalidOptionError(f"method={type(method).__name__}() but the plan was made by "
                                 f"method '{saved.method}'; pass one of them")
    chosen = method if method is not None else PipeshardParallel()

    def wrap(f: Callable) -> ParallelizedStep:
        step = ParallelizedStep(f, chosen, tuple(batch_argnums), devices, saved)
        step.method_defaulted = method is None
        return step

    return wrap if fn is None else wrap(fn)
