"""The full search (``AutoParallel``): its tracing (the plain step, and the pipeline cut when
pipelines are candidates) and its planning (``full_search``): every one-stage candidate (each
method, ShardParallel also on a 2-D mesh) and the pipelined one planned on the same cost model,
the fastest plan fitting the memory budget kept, with a planning record of every candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.graph.trace import TracedStep, build_graph, trace_step
from autopar.compiler.planners.annotations import user_layout
from autopar.compiler.planners.common import cut_into_microbatches
from autopar.compiler.planners.full_search import FullSearch, OneStagePlanner, PipelinePlanner
from autopar.compiler.planners.step_program import IlpObserver, PlannedProgram, StepProgram
from autopar.errors import BatchSizeError, NoLossFunctionError
from autopar.ir.flatten import trace_jaxpr
from autopar.methods import AutoParallel
from autopar.plan import MethodName


def trace_auto(fn: Callable, args: Sequence[Any], method: AutoParallel,
               batch_argnums: tuple[int, ...]) -> StepProgram:
    """The plain step (for the one-stage candidates) and, when pipelines are candidates and
    the step can be pipelined, its pipeline cut."""
    jaxpr = trace_jaxpr(fn, args)
    step = StepProgram(trace_step(fn, args, jaxpr=jaxpr), method, batch_argnums, fn=fn,
                       args=tuple(args))
    step.memo.jaxpr = jaxpr
    step.annotations = user_layout(args, jaxpr.in_paths)
    if MethodName.PIPESHARD not in method.candidates:
        return step
    try:
        pp = cut_into_microbatches(fn, args, batch_argnums, method.num_microbatches,
                                    jaxpr=jaxpr,
                                    per_microbatch_statistics=method.per_microbatch_statistics)
    except (NoLossFunctionError, BatchSizeError) as err:
        step.notes.append(f"no pipelined candidate: {err}")
        return step
    step.pipeline = pp
    step.pipeline_traced = TracedStep(pp.outer, build_graph(pp.outer))
    return step


def plan_auto(step: StepProgram, cluster: ClusterSpec, ilp_observer: IlpObserver | None, *,
              plan_one_stage: OneStagePlanner, plan_pipelined: PipelinePlanner) -> PlannedProgram:
    """The full search: every candidate method planned on the same cost model, the fastest
    plan fitting the memory budget kept (``full_search.FullSearch``). Its planning record
    lists every candidate (the pipelined ones each stage partition the stage search compared)
    with its estimate.

    ``plan_one_stage(step, cluster, ilp_observer, budget, beat)`` and ``plan_pipelined(step,
    method, traced, cluster)`` plan one candidate: passed in rather than imported, since they are
    ``dispatch``'s, the one place that dispatches on the method's type, which imports this
    module."""
    return FullSearch(step, cluster, ilp_observer, plan_one_stage, plan_pipelined).run()
