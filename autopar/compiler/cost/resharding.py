"""The cost of moving a tensor from one sharding spec to another on a logical mesh.

Per tensor dimension, the mesh axes splitting it in the source and the destination share a
common prefix; axes past the prefix are released by the source or acquired by the destination.
An acquired axis that nobody released is a local slice (free: every device already holds the
data). A released axis that another dimension acquires moves its split there: an all-to-all
over the moved axes. Every other released axis is gathered: one all-gather per tensor
dimension, over the axes that dimension releases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.compiler.cost.collectives import estimate_collective
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import TensorInfo
from autopar.plan import CollectiveEstimate, CollectiveKind, ShardingSpec


@dataclass(frozen=True)
class ReshardCost:
    """Seconds to reshard, and the collectives that does (empty when free)."""

    time_s: float
    collectives: tuple[CollectiveEstimate, ...]


FREE = ReshardCost(0.0, ())


def _shards(spec_axes: set[str], mesh: LogicalMesh) -> int:
    return math.prod(mesh.axis_size(a) for a in spec_axes)


def reshard_cost(
    src: ShardingSpec, dst: ShardingSpec, tensor: TensorInfo, mesh: LogicalMesh
) -> ReshardCost:
    """Cost of turning ``tensor`` laid out as ``src`` into ``dst`` on ``mesh``."""
    if src == dst or tensor.ndim == 0:
        return FREE
    if src.ndim != tensor.ndim or dst.ndim != tensor.ndim:
        raise ValueError(f"spec rank mismatch for tensor of shape {tensor.shape}: {src} -> {dst}")
    released: dict[str, int] = {}
    acquired: dict[str, int] = {}
    for d in range(tensor.ndim):
        s, t = src.dims[d], dst.dims[d]
        p = 0
        while p < min(len(s), len(t)) and s[p] == t[p]:
            p += 1
        for a in s[p:]:
            released[a] = d
        for a in t[p:]:
            acquired[a] = d
    moved = [a for a, d in released.items() if a in acquired and acquired[a] != d]
    gathered = [a for a in released if a not in moved]
    if not moved and not gathered:
        return FREE
    src_axes = {a for axes in src.dims for a in axes}
    collectives: list[CollectiveEstimate] = []
    if moved:
        # One all-to-all over the moved axes: it exchanges the whole tensor of its group, i.e.
        # the tensor divided by the splits of every axis that does not take part.
        group_bytes = tensor.nbytes / _shards(src_axes - set(moved), mesh)
        axes = tuple(sorted(mesh.axis_index(a) for a in moved))
        collectives.append(
            estimate_collective(CollectiveKind.ALL_TO_ALL, group_bytes, mesh, axes)
        )
    # Gathers one tensor dimension at a time, minor dimension first, each over all the axes it
    # releases, as XLA's partitioner does (seen in jax 0.10's CPU HLO: a dimension split over
    # both axes of a 2x4 mesh is gathered whole by one all-gather over its 8 devices; P('x','y')
    # and P('y','x') are gathered by two, the minor dimension's first). Each one's result is
    # split only by the axes still to be gathered and those that stay.
    remaining = set(src_axes)
    by_dim: dict[int, list[str]] = {}
    for a in gathered:
        by_dim.setdefault(released[a], []).append(a)
    for d in sorted(by_dim, reverse=True):
        remaining.difference_update(by_dim[d])
        group_bytes = tensor.nbytes / _shards(remaining, mesh)
        axes = tuple(sorted(mesh.axis_index(a) for a in by_dim[d]))
        collectives.append(
            estimate_collective(CollectiveKind.ALL_GATHER, group_bytes, mesh, axes)
        )
    return ReshardCost(sum(c.time_s for c in collectives), tuple(collectives))
