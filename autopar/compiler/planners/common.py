"""Pieces every planning method needs to turn its choices into a Plan."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypedDict

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.batch_coupling import coupled_examples
from autopar.compiler.graph.opgraph import OpGraph
from autopar.compiler.graph.trace import build_graph
from autopar.errors import CoupledBatchError
from autopar.ir.flatten import StepJaxpr
from autopar.ir.pipeline_program import PipelineProgram, build_pipeline_program
from autopar.plan import InputSignature, MethodName, Plan, StagePlan

# Full collections of Python's cyclic collector while planning: after this many collections of
# the middle generation (Python's default is 10).
FULL_COLLECTION_EVERY = 100


class PlanPlace(TypedDict):
    """Where a one-stage plan runs: the keyword arguments every one-stage planner takes."""

    batch_argnums: tuple[int, ...]
    cluster_name: str
    devices_per_host: int


@contextmanager
def fewer_full_collections() -> Iterator[None]:
    """Python's cyclic collector, calmer while planning: a full collection after
    ``FULL_COLLECTION_EVERY`` collections of the middle generation rather than 10, and none of
    them scanning the objects that were alive when the block began (``gc.freeze``), until the
    block ends (thresholds and freezing are put back then, also on an error).

    Planning a large model keeps millions of objects alive (the traced program, its graphs, the
    layer-cost caches) and every full collection scans them all: GPT-39B's full search on the
    64-GPU testbed made 23, 8.1 s of 44.7 s; with the rarer collections around its trace and
    its plan (``dispatch``), 7 and 3.2 s of 40.9 s. What the process held before (a plan made
    earlier, the caller's own objects) was scanned again by each: Megatron's 1T row searched
    in 44.5 s after its pinned plan, 41.2 s with that frozen (40.4 s alone). Frozen objects
    are also the ones a forked solver (``inter_op.forked``) no longer copies by touching them.
    A process that froze objects itself is left as it is: unfreezing would release its own.
    Reference counting still frees at once everything that is not in a cycle."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, max(full, FULL_COLLECTION_EVERY))
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        gc.set_threshold(young, middle, full)


def cut_into_microbatches(fn: Any, args: Sequence[Any], batch_argnums: Sequence[int],
                          num_microbatches: int, jaxpr: StepJaxpr | None = None, *,
                          per_microbatch_statistics: bool = False) -> PipelineProgram:
    """``build_pipeline_program``, refusing (``CoupledBatchError``) a loss function that mixes
    the examples of its batch when there is more than one microbatch: the pipeline's mean of
    the microbatches' losses would not be the step's loss (``graph.batch_coupling``), unless
    ``per_microbatch_statistics`` (the user asked for GPipe's semantics)."""
    pp = build_pipeline_program(fn, args, batch_argnums, num_microbatches, jaxpr=jaxpr)
    if num_microbatches > 1 and not per_microbatch_statistics:
        graph = build_graph(pp.forward)
        inputs = {io.tensor for io in graph.inputs}
        where = coupled_examples(graph, [t for t in pp.split_inputs if t in inputs])
        if where is not None:
            raise CoupledBatchError(
                f"the loss function mixes the examples of its batch ({where}): cut into "
                f"{num_microbatches} microbatches it would compute another loss; use "
                "num_microbatches=1, a one-stage method, or per_microbatch_statistics=True "
                "(each microbatch its own statistics)")
    return pp


def signature_of(graph: OpGraph) -> list[InputSignature]:
    """Path, shape and dtype of every input leaf: what the plan is valid for."""
    return [
        InputSignature(io.path, graph.tensors[io.tensor].shape, graph.tensors[io.tensor].dtype)
        for io in graph.inputs
    ]


def submesh_shape(mesh: LogicalMesh, devices_per_host: int) -> tuple[int, int]:
    """(hosts, devices per host) that the mesh's devices occupy."""
    hosts = {d // devices_per_host for d in mesh.device_ids}
    return (len(hosts), mesh.num_devices // len(hosts))


def whole_mesh_plan(
    method: MethodName,
    mesh: LogicalMesh,
    graph: OpGraph,
    *,
    cluster_name: str,
    devices_per_host: int,
    batch_argnums: tuple[int, ...],
    compute_s: float,
    comm_s: float,
    memory: dict[str, int],
    axis_names: tuple[str, ...] | None = None,
    solver: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    **stage_fields: Any,
) -> Plan:
    """A one-stage plan over the whole ``mesh``: the stage's timing and memory from the
    method's estimates, its shardings and collectives from ``stage_fields``."""
    stage = StagePlan(
        index=0,
        layers=(0,),
        submesh_shape=submesh_shape(mesh, devices_per_host),
        logical_mesh_shape=tuple(mesh.shape),
        axis_names=tuple(axis_names if axis_names is not None else mesh.axis_names),
        device_ids=tuple(mesh.device_ids),
        est_time_s=compute_s + comm_s,
        est_compute_time_s=compute_s,
        est_communication_time_s=comm_s,
        peak_memory_bytes=sum(memory.values()),
        memory_breakdown=memory,
        **stage_fields,
    )
    return Plan(
        method=method,
        mesh_shape=tuple(mesh.shape),
        cluster=cluster_name,
        stages=[stage],
        est_step_time_s=stage.est_time_s,
        total_flops=graph.total_flops,
        signature=signature_of(graph),
        batch_argnums=tuple(batch_argnums),
        solver=solver,
        notes=list(notes or []),
    )
