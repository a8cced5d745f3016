"""What runs once per step around a pipeline's microbatches, and how a piece's ILP prices it.

The step's own work outside the loss forward and backward (``StepWork``: the optimizer
update per parameter element, the preprocessing before the loss), and the rewrite of a piece's
ILP (``amortise``) that prices the per-step parts of its small train step, the gradients'
reduction and the update, once per step rather than once per microbatch
(``layer_costs`` solves the ILP; this module says what a step adds to it).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.fusion import kernel_bytes, kernel_launches
from autopar.compiler.graph.opgraph import SCAN_EXIT, OpGraph
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.intra_op.edges import input_needs
from autopar.compiler.intra_op.sharding_ilp import ProblemParts
from autopar.ir.pipeline_program import PipelineProgram

# Ops a parameter's gradient passes through on its way from the node that sums it over the
# batch (a weight gradient's dot, a bias gradient's reduce) to the update: the walk back from
# the update stops at the first op not in this list, which is that node. A scan region's exit
# is one too, and a split or slice: a scanned layer's gradient is made inside the body (each
# iteration's slice of a stacked parameter's gradient, a ``ys``), the exit only stacks it and
# the split (the transpose of the concatenation that feeds a stage's layers to one scan over
# their slices) cuts each layer's out; stopping there would leave the body's reduction priced
# per microbatch, not per step as the unrolled layer's.
_GRADIENT_PASS_THROUGH = frozenset({
    "transpose", "reshape", "convert_element_type", "copy", "copy_p", "squeeze", "add",
    "add_any", "reduce_precision", "slice", "split", SCAN_EXIT,
})


@dataclass(frozen=True)
class StepWork:
    """Work of the step outside the loss forward and its backward, from the traced step:
    ``update_flops``: per dtype, flops of the equations after the gradients (the optimizer
    update, a gradient norm) per parameter element; ``before_flops``: per dtype, flops of
    the equations before the loss function (batch preprocessing), per step;
    ``update_bytes``: what the update's kernels read and write per parameter element
    (``graph.fusion``: Adam reads a parameter, its gradient and two moments and writes
    three); ``update_kernels``: the kernels the update starts per parameter
    (``graph.fusion.kernel_launches``), ``before_kernels`` the preprocessing's per step."""

    update_flops: dict[str, float]
    before_flops: dict[str, float]
    param_elements: float
    update_bytes: float = 0.0
    update_kernels: float = 0.0
    before_kernels: float = 0.0

    def update_seconds(self, elements: float, mesh: LogicalMesh) -> float:
        """Seconds of the update of ``elements`` parameter elements on one device of
        ``mesh``: its flops, or its bytes at the memory bandwidth where that is slower (its
        kernels' launches, the same under every plan, are ``update_launch_s``)."""
        seconds = math.fsum(per * elements / _rate(mesh, dtype)
                            for dtype, per in self.update_flops.items())
        bandwidth = mesh.device.memory_bandwidth_bytes_per_s
        return max(seconds, self.update_bytes * elements / bandwidth) if bandwidth else seconds

    def update_launch_s(self, mesh: LogicalMesh) -> float:
        """Seconds of the launches of one parameter's update kernels."""
        return self.update_kernels * mesh.device.kernel_launch_s

    def before_seconds(self, mesh: LogicalMesh, parts: int) -> float:
        """Seconds of the preprocessing, split ``parts`` ways (the batch's devices)."""
        return math.fsum(f / max(parts, 1) / _rate(mesh, dtype)
                         for dtype, f in self.before_flops.items()) + \
            self.before_kernels * mesh.device.kernel_launch_s


def _rate(mesh: LogicalMesh, dtype: str) -> float:
    return mesh.device.flops_for(dtype) * mesh.compute_efficiency


def step_work(pp: PipelineProgram, outer_graph: OpGraph | None = None) -> StepWork:
    """The step's own work around the pipeline (see :class:`StepWork`), priced per node as
    the one-stage planners price it (each node's flops at its result's dtype).
    ``outer_graph``: ``pp.outer``'s graph where the caller has it built."""
    outer = pp.outer
    graph = build_graph(outer) if outer_graph is None else outer_graph
    after = set(pp.vg.outputs)
    update: defaultdict[str, float] = defaultdict(float)
    before: defaultdict[str, float] = defaultdict(float)
    moved = 0.0
    kernels = {"update": 0, "before": 0}
    for node in graph.nodes:
        if node.id == pp.vg_index:
            continue
        dtype = graph.tensors[node.outputs[0]].dtype if node.outputs else "float32"
        if any(t in after for t in node.inputs):
            after.update(node.outputs)
            update[dtype] += node.flops
            moved += kernel_bytes(graph, node)
            kernels["update"] += kernel_launches(graph, node)
        else:
            before[dtype] += node.flops
            kernels["before"] += kernel_launches(graph, node)
    elements = float(sum(math.prod(outer.avals[pp.operand_of[f]].shape)
                         for f in pp.diff_inputs))
    per = {d: f / elements for d, f in update.items() if f} if elements else {}
    params = len(pp.diff_inputs)
    return StepWork(per, {d: f for d, f in before.items() if f}, elements,
                    moved / elements if elements else 0.0,
                    kernels["update"] / params if params else 0.0, kernels["before"])


def gradient_nodes(graph: OpGraph) -> tuple[dict[int, int], set[int]]:
    """The placeholder update ``p - g`` of every parameter (node id -> the operand position of
    its gradient), and the nodes that make the gradients (each reached back from ``g``
    through ``_GRADIENT_PASS_THROUGH`` ops, up to and including the first other op)."""
    updates: dict[int, int] = {}
    for io in graph.outputs:
        if not io.path.startswith("out/0/p/"):
            continue
        node = graph.nodes[graph.producer[io.tensor]]
        if node.primitive == "sub" and len(node.inputs) == 2:
            updates[node.id] = 1
    makers: set[int] = set()
    stack = [graph.nodes[u].inputs[k] for u, k in updates.items()]
    while stack:
        t = stack.pop()
        n = graph.producer.get(t)
        if n is None or n in makers:
            continue
        makers.add(n)
        node = graph.nodes[n]
        if node.primitive in _GRADIENT_PASS_THROUGH:
            stack.extend(node.inputs)
    return updates, makers


def amortise(problem: Any, parts: ProblemParts, graph: OpGraph, mesh: LogicalMesh,
              work: StepWork, m: int) -> Any:
    """Rewrite ``problem`` (in place) so that the per-step parts cost what they cost per
    microbatch: the gradients' collectives (their makers' own and the resharding into the
    update) divided by ``m``, and each placeholder update's compute replaced by the step's
    update of that parameter, divided by ``m``. Returns a function of the chosen strategies
    giving (sync, update, placeholder compute) seconds per step."""
    table = parts.table
    updates, makers = gradient_nodes(graph)
    keep = 1.0 / max(m, 1)
    sizes = {a: mesh.axis_size(a) for a in mesh.axis_names}
    edges = {(e.src, e.dst): e for e in problem.edges}

    def update_s(member: int, strategy: Any) -> float:
        info = graph.tensors[graph.nodes[member].outputs[0]]
        shards = strategy.output_specs[0].num_shards(sizes)
        return work.update_seconds(info.size / shards, mesh)

    uses: list[tuple[int, int, np.ndarray]] = []  # (producer, consumer variable, matrix)
    for u, k in updates.items():
        t = graph.nodes[u].inputs[k]
        if t not in table.tensor_home:
            continue
        consumer = table.variable_of(u)
        strategies = consumer.members[u]
        matrix = parts.edges.use_matrix(t, partial(input_needs, strategies, k),
                                        ("use", id(strategies), k))
        uses.append((table.home_variable(t).index, consumer.index, matrix))
    for var, node in zip(table.variables, problem.nodes, strict=True):
        costs = list(node.costs)
        for member, strategies in var.members.items():
            if member in makers:
                for c, st in enumerate(strategies):
                    costs[c] -= (1.0 - keep) * st.communication_time_s
            if member in updates:
                for c, st in enumerate(strategies):
                    costs[c] += keep * update_s(member, st) - st.compute_time_s
        node.costs = [max(c, 0.0) for c in costs]
    for src, dst, matrix in uses:
        if src == dst:
            node = problem.nodes[src]
            node.costs = [max(c - (1.0 - keep) * d, 0.0)
                          for c, d in zip(node.costs, matrix.diagonal(), strict=True)]
        elif (src, dst) in edges:
            edge = edges[(src, dst)]
            edge.costs = np.maximum(edge.costs - (1.0 - keep) * matrix, 0.0)

    fed = {-(1 + k) for k, io in enumerate(graph.inputs) if io.path.startswith("batch/")}

    def per_step(choices: list[int]) -> tuple[float, float, float, float]:
        """(sync, update, placeholder compute, feed) seconds of the chosen strategies."""
        sync = update = placeholder = feed = 0.0
        for var, c in zip(table.variables, choices, strict=True):
            for member, strategies in var.members.items():
                if member in makers:
                    sync += strategies[c].communication_time_s
                if member in updates:
                    update += update_s(member, strategies[c])
                    placeholder += strategies[c].compute_time_s
                if member in fed:
                    feed += strategies[c].cost
        for src, dst, matrix in uses:
            sync += float(matrix[choices[src], choices[dst]])
        return sync, update, placeholder, feed

    return per_step
