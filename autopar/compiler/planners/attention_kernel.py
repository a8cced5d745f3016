"""The step planned with its softmax attentions run by autopar's kernel (issue 35).

Where neither the step's own equations nor its recomputed layers fit the memory budget
(``remat="auto"``), a step whose attentions the kernel can run (``graph.attention_forms``) is
traced again with them rewritten (``ir.attention_rewrite``): its backward keeps O(sequence)
per attention rather than the probabilities, and the sharding ILP chooses per attention
whether to split the sequence over a mesh axis, as ring attention or with the keys and values
gathered (``strategies.attention``): context parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autopar.cluster import ClusterSpec
from autopar.compiler.cost.memory_model import estimate_memory
from autopar.compiler.graph.attention import find_attention
from autopar.compiler.intra_op.problem import InfeasibleMemoryError
from autopar.compiler.intra_op.strategies.attention import (
    GATHER,
    RING,
    attention_nodes,
    sequence_splits,
)
from autopar.compiler.planners.step_program import IlpObserver, PlannedProgram, StepProgram
from autopar.errors import format_bytes
from autopar.method_options import RematMode
from autopar.methods import ShardParallel
from autopar.plan import Plan

# a tensor split this many ways holds nothing: what the floor leaves out
NEVER_HELD = 2**62
# ``dispatch._plan_one_stage``: (traced, method, cluster, batch_argnums, observer, memo, beat)
OneStage = Callable[..., Plan]


def plan_attention_kernel(step: StepProgram, cluster: ClusterSpec, plan_one_stage: OneStage,
                          ilp_observer: IlpObserver | None, beat: float | None,
                          short: Exception | PlannedProgram) -> PlannedProgram | None:
    """The sharding plan of the step with its loss function's attentions run by autopar's
    kernel, whose residuals are O(sequence) (``ir.attention_rewrite``; the ILP may split the
    sequence over a mesh axis and run them as ring attention): for a ``ShardParallel`` with
    ``remat="auto"`` whose plans did not fit (``short``: the error that said so, or the
    least-memory plan). None where it is not tried or saves nothing; where it fits nothing
    either, the error that names the smaller memory is raised."""
    method = step.method
    if (not isinstance(method, ShardParallel) or method.remat != RematMode.AUTO
            or step.fn is None):
        return None
    budget = (short.budget if isinstance(short, InfeasibleMemoryError)
              else method.memory_budget_bytes or cluster.device.memory_bytes)
    if _kernel_cannot_fit(step, cluster, budget):
        return None
    traced = step.with_attention_kernel()
    if traced is None:
        return None
    try:
        plan = plan_one_stage(traced, method, cluster, step.batch_argnums, ilp_observer,
                              step.memo, beat)
    except InfeasibleMemoryError as err:
        if isinstance(short, InfeasibleMemoryError) and err.min_peak_bytes < short.min_peak_bytes:
            raise err from None
        return None
    if isinstance(short, PlannedProgram) and plan.peak_memory_bytes >= short.plan.peak_memory_bytes:
        return None
    splits = sequence_splits(traced.graph, plan.stages[0])
    context = [f"{splits[RING]} as ring attention"] if splits[RING] else []
    if splits[GATHER]:
        context.append(f"{splits[GATHER]} with the queries split and the keys and values "
                       "gathered")
    # what it saved: against the least any plan of the step's own equations needs (the
    # error's figure) or the least-memory such plan found (over the budget)
    least = (short.min_peak_bytes if isinstance(short, InfeasibleMemoryError)
             else short.plan.peak_memory_bytes if isinstance(short, PlannedProgram) else None)
    saved = "" if least is None else (
        f"; {format_bytes(plan.peak_memory_bytes)} per device, where the step's own "
        f"equations need at least {format_bytes(least)}")
    plan = replace(plan, attention_kernel=True).noted(
        f"attention as one kernel: {len(attention_nodes(traced.graph))} attention(s) keep "
        "O(sequence) for the backward, not their probabilities"
        + (f"; context parallel (the sequence split over the mesh): {', '.join(context)}"
           if context else "") + saved)
    return PlannedProgram(traced, plan)


def _kernel_cannot_fit(step: StepProgram, cluster: ClusterSpec, budget: float) -> bool:
    """Whether the step with every tensor split over all devices and every block of scores
    left out (each tensor ending in an attention's [queries, keys], its gradients' too: what
    the kernel never holds whole) is still over ``budget``: then no plan with the kernel fits
    either, and the step is not traced again for it."""
    graph = step.traced.graph
    n = max(1, cluster.num_devices)
    # the same floor for every candidate on these devices (three at GPT-39B's search): once
    key: tuple = (id(graph), "kernel", (n,), frozenset())
    floor = step.memo.memory_floors.get(key)
    if floor is None:
        blocks = {(site.query_length, site.key_length) for site in find_attention(graph)}
        if not blocks:
            return True
        shards = {t: NEVER_HELD if info.ndim >= 2 and info.shape[-2:] in blocks else n
                  for t, info in graph.tensors.items()}
        floor = estimate_memory(graph, batch_argnums=step.batch_argnums, shards=shards)
        step.memo.memory_floors[key] = floor
    return floor.total > budget
