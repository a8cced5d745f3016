"""What the compiler plans and what it gives back: a traced step (:class:`StepProgram`) and a
plan with the program its tensor ids refer to (:class:`PlannedProgram`). Apart from
``dispatch``, so that the full search (``auto``), which ``dispatch`` calls, makes and returns
them without importing ``dispatch`` back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autopar.compiler.cost.memory_floor import memory_floor, mesh_memory_floor
from autopar.compiler.cost.memory_model import MemoryEstimate
from autopar.compiler.graph.attention_forms import trace_with_attention_kernel
from autopar.compiler.graph.trace import TracedStep, build_graph, trace_step
from autopar.compiler.inter_op.layers import remat_layer_positions
from autopar.compiler.planners.annotations import UserLayout
from autopar.compiler.planners.status import PlanningStatus
from autopar.errors import NoLossFunctionError
from autopar.ir.flatten import StepJaxpr, trace_jaxpr
from autopar.ir.pipeline_program import PipelineProgram, build_pipeline_program
from autopar.methods import Method
from autopar.plan import Plan

IlpObserver = Callable[[Any, Any], None]


class TraceNeeded(Exception):  # noqa: N818 - a signal between planners, never the user's
    """A planner needed to trace the step again where it must not (``TraceMemo.may_trace``:
    a forked child, where JAX is not called); the caller plans that candidate itself."""


@dataclass
class TraceMemo:
    """Traces of one step that every candidate planned from it shares: the step again with its
    loss function's layers under ``jax.checkpoint`` (``remat``: the traced step and the layer
    positions, or the error that tracing raised), which the full search's one-stage candidates
    would otherwise each trace anew. ``memory_floors``: per (graph, device count or mesh
    shape), the memory of the step with every tensor split over that many devices, or as
    far as a layout on that mesh splits it (``memory_floor``). ``jaxpr``: the step traced once
    at its arguments' shapes (``flatten.trace_jaxpr``), which each form of it (plain,
    pipeline cut, rematerialised) walks rather than tracing the user's code again."""

    jaxpr: StepJaxpr | None = None
    remat: tuple[TracedStep, tuple[int, ...]] | Exception | None = None
    # the same with the layers' matmul outputs kept (``remat="selective"``)
    remat_selective: tuple[TracedStep, tuple[int, ...]] | Exception | None = None
    # the step with its attentions run by the kernel (``attention_forms``); False: it has none
    attention_kernel: TracedStep | bool | None = None
    memory_floors: dict[tuple, MemoryEstimate] = field(default_factory=dict)
    # sharding problems built without a budget (``solve_intra_op``'s ``built``) and the
    # fastest one-stage plans, by (graph, mesh, ILP options): the full search comes back to a
    # candidate whose fastest plan did not fit once it knows what fits (``CannotWinError``)
    problems: dict[tuple, Any] = field(default_factory=dict)
    fastest: dict[tuple, Plan] = field(default_factory=dict)
    # the sharding ILP's strategy lists, resharding costs and edge matrices (``MeshCaches``)
    # by (graph, cluster, mesh shape): what the builds of one graph on one mesh share, pinned
    # or not (pins key their own input lists), e.g. the full search's free ``shard`` candidate
    # and the user's layout pinned on the same mesh
    mesh_caches: dict[tuple, Any] = field(default_factory=dict)
    # False in a forked child: a trace it would need raises ``TraceNeeded`` instead
    may_trace: bool = True

    def memory_floor(self, traced: TracedStep, batch_argnums: tuple[int, ...],
                     num_devices: int, host: frozenset[int] = frozenset()) -> MemoryEstimate:
        """``memory_floor`` of ``traced``'s graph with every tensor split over
        ``num_devices`` devices (``host``: tensors kept in host memory between steps),
        computed once (the meshes of as many devices share it)."""
        key = (id(traced.graph), "devices", (num_devices,), host)
        if key not in self.memory_floors:
            self.memory_floors[key] = memory_floor(traced.graph, batch_argnums=batch_argnums,
                                                   num_devices=num_devices, host=host)
        return self.memory_floors[key]

    def mesh_memory_floor(self, traced: TracedStep, batch_argnums: tuple[int, ...],
                          mesh_shape: tuple[int, ...],
                          host: frozenset[int] = frozenset()) -> MemoryEstimate:
        """``mesh_memory_floor`` of ``traced``'s graph on a mesh of ``mesh_shape`` (at or
        above ``memory_floor``'s on as many devices, which it reads), computed once."""
        key = (id(traced.graph), "mesh", tuple(mesh_shape), host)
        if key not in self.memory_floors:
            everywhere = self.memory_floor(traced, batch_argnums, math.prod(mesh_shape), host)
            self.memory_floors[key] = mesh_memory_floor(
                traced.graph, batch_argnums=batch_argnums, mesh_shape=mesh_shape,
                everywhere=everywhere, host=host)
        return self.memory_floors[key]


@dataclass
class StepProgram:
    """A traced step as the compiler plans it.

    ``traced``: the program (and graph) the plan's tensor ids refer to; for a pipelined
    method the outer program, which holds the loss function as one equation. ``pipeline``:
    the pipeline cut (loss forward, pieces' inputs) when the method pipelines. ``fn`` and
    ``args``: the step itself, for tracing again with rematerialised layers. ``method``: what
    will plan it (the full search's one-stage fallback replaces a pipeline method that cannot
    pipeline this step). ``notes``: what the plan should say about how it was traced.
    """

    traced: TracedStep
    method: Method
    batch_argnums: tuple[int, ...]
    pipeline: PipelineProgram | None = None
    fn: Callable | None = None
    args: tuple[Any, ...] = ()
    notes: list[str] = field(default_factory=list)
    # the full search (AutoParallel): ``traced`` is the plain step (its one-stage candidates'
    # program), this the pipeline's outer program (its pipelined candidates')
    pipeline_traced: TracedStep | None = None
    memo: TraceMemo = field(default_factory=TraceMemo)
    # the full search: the inputs committed to the user's own mesh (``annotations``)
    annotations: UserLayout | None = None
    # what the planner is doing, for a progress display (written, never read, by planners)
    status: PlanningStatus = field(default_factory=PlanningStatus)

    def rematerialised(self, selective: bool = False
                       ) -> tuple[TracedStep, tuple[int, ...]] | Exception:
        """The step traced again with its loss function's layers under ``jax.checkpoint``
        (``selective``: keeping their matmuls' outputs), and their positions (or the error
        that says it has no layers to recompute): traced once, on first use
        (``TraceMemo.remat``, ``remat_selective``)."""
        memo = self.memo
        found = memo.remat_selective if selective else memo.remat
        if found is None:
            fn, jaxpr = self._to_trace("the rematerialised step")
            try:
                other = memo.remat if selective else memo.remat_selective
                if isinstance(other, tuple):
                    positions = other[1]
                else:
                    pp = build_pipeline_program(fn, self.args, self.batch_argnums, 1,
                                                jaxpr=jaxpr)
                    positions = tuple(remat_layer_positions(pp, build_graph(pp.forward)))
                found = (trace_step(fn, self.args, remat_positions=positions, jaxpr=jaxpr,
                                    remat_selective=selective), tuple(positions))
            except NoLossFunctionError as err:
                found = err
            if selective:
                memo.remat_selective = found
            else:
                memo.remat = found
        return found

    def with_attention_kernel(self) -> TracedStep | None:
        """The step traced again with its loss function's attentions run by the kernel (None:
        it has none the kernel can run, or no ``autopar.value_and_grad``): traced once."""
        memo = self.memo
        if memo.attention_kernel is None:
            fn, jaxpr = self._to_trace("the step with its attention kernel")
            memo.attention_kernel = trace_with_attention_kernel(fn, self.args,
                                                                jaxpr=jaxpr) or False
        found = memo.attention_kernel
        return found if isinstance(found, TracedStep) else None

    def _to_trace(self, what: str) -> tuple[Callable, StepJaxpr]:
        """The step and its jaxpr (traced once), for another form of it (``what``) to walk;
        ``TraceNeeded`` where this process must not trace (a forked child) or has no step."""
        memo = self.memo
        if not memo.may_trace or self.fn is None:
            raise TraceNeeded(f"{what} is not traced here")
        if memo.jaxpr is None:
            memo.jaxpr = trace_jaxpr(self.fn, self.args)
        return self.fn, memo.jaxpr

    @property
    def programs(self) -> tuple[Any, ...]:
        """The flat programs that identify the step (what a plan cache key hashes): for a
        pipeline also the microbatch forward, which tells two loss functions apart."""
        if self.pipeline is not None and self.pipeline_traced is None:
            return (self.pipeline.outer, self.pipeline.forward)
        if self.pipeline is not None:
            return (self.traced.program, self.pipeline.forward)
        return (self.traced.program,)

    def parts_for(self, plan: Plan) -> tuple[TracedStep, PipelineProgram | None]:
        """The traced program and pipeline cut that ``plan`` (made for this step) runs on."""
        if plan.is_pipelined:
            return (self.pipeline_traced or self.traced), self.pipeline
        return self.traced, None


@dataclass
class PlannedProgram:
    """A plan and the program its tensor ids refer to (traced again when rematerialised).
    ``candidates``: for the full search, every candidate's plan by name (the benchmark runs
    them as its baselines; not saved with the plan)."""

    traced: TracedStep
    plan: Plan
    pipeline: PipelineProgram | None = None
    candidates: dict[str, PlannedProgram] = field(default_factory=dict)

    def with_plan(self, plan: Plan) -> PlannedProgram:
        """This program with ``plan`` in place of its plan, also as the candidate that held
        it (the chosen candidate is found by its plan)."""
        candidates = {name: (PlannedProgram(c.traced, plan, c.pipeline, c.candidates)
                             if c.plan is self.plan else c)
                      for name, c in self.candidates.items()}
        return PlannedProgram(self.traced, plan, self.pipeline, candidates)
