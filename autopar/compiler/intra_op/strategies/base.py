"""What a sharding strategy is, and the helpers every strategy family shares.

A strategy of a node is one way to run it on a logical mesh: the spec of each output, the spec
each operand must arrive in, and what it costs — compute (its flops divided over the devices
that really share the work), and the collectives the node itself performs (a contraction over
a split dimension leaves partial sums: an all-reduce, or a reduce-scatter when the output is
left split). Moving an operand from its producer's spec to the required spec is not part of
the strategy: that is the resharding cost on the edge, priced separately.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from autopar.compiler.cost.collectives import estimate_collective
from autopar.compiler.cost.estimate import roofline_time_s
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.fusion import kernel_bytes
from autopar.compiler.graph.opgraph import OpGraph, OpNode, TensorInfo
from autopar.plan import CollectiveEstimate, CollectiveKind, ShardingSpec


@dataclass(frozen=True)
class Strategy:
    """One way to shard one node.

    ``input_specs[i]`` is the spec operand ``i`` must have (``None``: no requirement, e.g. a
    scalar or a literal, which every device holds whole). ``compute_time_s`` and
    ``communication_time_s`` are seconds on the mesh; ``collectives`` lists what the node
    itself communicates (kinds, full-tensor bytes, mesh axes) for reports and HLO comparison.
    """

    name: str
    output_specs: tuple[ShardingSpec, ...]
    input_specs: tuple[ShardingSpec | None, ...]
    compute_time_s: float = 0.0
    communication_time_s: float = 0.0
    collectives: tuple[CollectiveEstimate, ...] = field(default=())

    @property
    def cost(self) -> float:
        return self.compute_time_s + self.communication_time_s


@dataclass(frozen=True)
class StrategyContext:
    """What a strategy generator may look at: the node, the graph's tensors, the mesh."""

    node: OpNode
    graph: OpGraph
    mesh: LogicalMesh

    def tensor(self, tid: int) -> TensorInfo:
        return self.graph.tensors[tid]

    @property
    def inputs(self) -> list[TensorInfo]:
        return [self.graph.tensors[t] for t in self.node.inputs]

    @property
    def outputs(self) -> list[TensorInfo]:
        return [self.graph.tensors[t] for t in self.node.outputs]

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    def axis_size(self, name: str) -> int:
        return self.mesh.axis_size(name)

    def axes_size(self, axes: Sequence[str]) -> int:
        return math.prod(self.mesh.axis_size(a) for a in axes)

    def axis_indices(self, axes: Sequence[str]) -> tuple[int, ...]:
        return tuple(self.mesh.axis_index(a) for a in axes)

    def compute_time(self, flops: float, parallel_axes: Sequence[str],
                     shape_efficiency: float = 1.0) -> float:
        """Seconds for ``flops`` of this node, and its kernel's bytes (``graph.fusion``), split
        evenly over the devices of ``parallel_axes`` (devices on other axes repeat the same
        work, so they do not shorten it): the slower of the two (``roofline_time_s``; a
        GEMM's flops at its ``shape_efficiency``, ``cost.gemm``)."""
        parts = self.axes_size(parallel_axes)
        return roofline_time_s(flops / parts, self.kernel_bytes / parts, self.mesh,
                               self.dominant_dtype, shape_efficiency,
                               gemm=self.node.primitive == "dot_general")

    @cached_property
    def kernel_bytes(self) -> float:
        """What the node's kernel reads and writes (``graph.fusion``), where the mesh's
        device has a memory bandwidth to price it at (else 0)."""
        if not self.mesh.device.memory_bandwidth_bytes_per_s:
            return 0.0
        return kernel_bytes(self.graph, self.node)

    @cached_property
    def dominant_dtype(self) -> str:
        outs = self.node.outputs
        return self.graph.tensors[outs[0]].dtype if outs else "float32"

    def collective(
        self, kind: CollectiveKind, nbytes: float, axes: Sequence[str]
    ) -> CollectiveEstimate:
        """One collective of ``nbytes`` (full tensor) over the named mesh axes, priced."""
        return estimate_collective(kind, nbytes, self.mesh, self.axis_indices(axes))


def divisible(size: int, ctx: StrategyContext, axes: Sequence[str]) -> bool:
    """Can a dimension of ``size`` be split evenly over ``axes``?"""
    return _divisible(size, ctx.mesh, axes)


def _divisible(size: int, mesh: LogicalMesh, axes: Sequence[str]) -> bool:
    n = math.prod(mesh.axis_size(a) for a in axes)
    return n > 1 and size % n == 0 if axes else True


def axis_groups(axis_names: Sequence[str]) -> list[tuple[str, ...]]:
    """Ways to give mesh axes to one tensor dimension: none, each axis alone, all in order."""
    groups: list[tuple[str, ...]] = [()]
    groups += [(a,) for a in axis_names]
    if len(axis_names) > 1:
        groups.append(tuple(axis_names))
    return groups


def specs_on_mesh(shape: Sequence[int], mesh: LogicalMesh) -> Iterator[ShardingSpec]:
    """Every spec of ``shape`` on ``mesh``: each mesh axis on at most one dimension, only
    dimensions divisible by their axes' size, axis sizes of 1 skipped (they split nothing)."""
    names = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
    choices = [None, *range(len(shape))]
    seen: set[tuple] = set()
    for assignment in itertools.product(choices, repeat=len(names)):
        dims: list[list[str]] = [[] for _ in shape]
        for axis, dim in zip(names, assignment, strict=True):
            if dim is not None:
                dims[dim].append(axis)
        if all(_divisible(shape[d], mesh, dims[d]) for d in range(len(shape))):
            key = tuple(tuple(d) for d in dims)
            if key not in seen:
                seen.add(key)
                yield ShardingSpec(key)


def enumerate_specs(shape: Sequence[int], ctx: StrategyContext) -> Iterator[ShardingSpec]:
    """Every spec of ``shape`` on the context's mesh (see :func:`specs_on_mesh`)."""
    return specs_on_mesh(shape, ctx.mesh)


def shard_bytes(info: TensorInfo, spec: ShardingSpec, ctx: StrategyContext) -> float:
    """Per-device bytes of ``info`` laid out as ``spec``."""
    return info.nbytes / spec.num_shards({a: ctx.axis_size(a) for a in ctx.axis_names})
