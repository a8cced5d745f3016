"""The cost of moving a tensor from one sharding spec to another on a logical mesh.

Per tensor dimension, the mesh axes splitting it in the source and the destination share a
common prefix; axes past the prefix are released by the source or acquired by the destination.
An acquired axis that nobody released is a local slice: no collective (every device already
holds the data); free, or where it splits a dimension of ``price_slice`` a kernel that reads and
writes the slice at the device's memory bandwidth (``slice_time_s``: what a reduction over that
dimension pays). A released axis that another dimension acquires moves its split there: an
all-to-all over the moved axes. Every other released axis is gathered: one all-gather per
tensor dimension, over the axes that dimension releases.
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


def slice_time_s(dst: ShardingSpec, tensor: TensorInfo, mesh: LogicalMesh) -> float:
    """Seconds of cutting each device's part ``dst`` out of ``tensor`` it holds more of: the
    part read and written once at the memory bandwidth (0 where the cluster does not describe
    it). Priced where a reduction reads the slice and sums over a dimension it splits
    (``edges``): it reduces less, but only to leave partial sums an all-reduce completes,
    and the bytes it saves are the ones the slice itself spends (and XLA, fusing the slice
    into the reduction, makes the sliced values twice, whole for their other readers and
    sliced for this one: on CPU devices the layer-norm backward chains of a GPT's bias
    gradients took 100 of a 400 ms step, GPT small on a 2 x 4 mesh, where the plan had priced
    the slices at nothing and the halved reductions as savings; docs/cost-model.md). Other
    slices are left free: a reduction sliced along a dimension it keeps splits its work as
    any op does, and other readers fuse a slice and read only their part. That also keeps
    the ILPs at published sizes as quick to prove: priced everywhere, Megatron 76.1B's
    search took 28 s against 22 s, its estimate within 0.1%; priced for every reduction,
    18.4B's took 31 s against 24 s (two of its most split layer ILPs)."""
    bandwidth = mesh.device.memory_bandwidth_bytes_per_s
    if bandwidth <= 0:
        return 0.0
    return 2.0 * tensor.nbytes / _shards({a for axes in dst.dims for a in axes}, mesh) / bandwidth


@dataclass(frozen=True)
class ReshardSteps:
    """What turning ``src`` into ``dst`` does on one mesh, whatever the tensor's size: the
    collectives, each as (kind, the number of shards its group's bytes are the tensor's
    bytes over, mesh axes), or where there are none the dimensions a local slice acquires
    axes on. Computed once per spec pair and mesh (``ReshardingEdges`` keeps them): a layer's
    ILP prices thousands of (spec pair, tensor size) moves, most pairs several times."""

    collectives: tuple[tuple[CollectiveKind, int, tuple[int, ...]], ...]
    sliced_dims: frozenset[int]


def reshard_steps(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> ReshardSteps:
    """The collectives (or the local slice) of resharding ``src`` to ``dst`` on ``mesh``
    (specs of one rank, not equal)."""
    released: dict[str, int] = {}
    acquired: dict[str, int] = {}
    for d, (s, t) in enumerate(zip(src.dims, dst.dims, strict=True)):
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
        return ReshardSteps((), frozenset(acquired.values()))
    src_axes = {a for axes in src.dims for a in axes}
    steps: list[tuple[CollectiveKind, int, tuple[int, ...]]] = []
    if moved:
        # One all-to-all over the moved axes: it exchanges the whole tensor of its group, i.e.
        # the tensor divided by the splits of every axis that does not take part.
        steps.append((CollectiveKind.ALL_TO_ALL, _shards(src_axes - set(moved), mesh),
                      tuple(sorted(mesh.axis_index(a) for a in moved))))
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
        steps.append((CollectiveKind.ALL_GATHER, _shards(remaining, mesh),
                      tuple(sorted(mesh.axis_index(a) for a in by_dim[d]))))
    return ReshardSteps(tuple(steps), frozenset())


def price_steps(steps: ReshardSteps, dst: ShardingSpec, tensor: TensorInfo, mesh: LogicalMesh,
                price_slice: frozenset[int] = frozenset()) -> ReshardCost:
    """``steps`` (``reshard_steps`` of a move to ``dst``) priced for ``tensor`` on ``mesh``
    (a slice: free, or ``slice_time_s`` where it splits a dimension of ``price_slice``)."""
    if not steps.collectives:
        priced = not price_slice.isdisjoint(steps.sliced_dims)
        return ReshardCost(slice_time_s(dst, tensor, mesh), ()) if priced else FREE
    collectives = tuple(estimate_collective(kind, tensor.nbytes / shards, mesh, axes)
                        for kind, shards, axes in steps.collectives)
    return ReshardCost(sum(c.time_s for c in collectives), collectives)


def reshard_cost(
    src: ShardingSpec, dst: ShardingSpec, tensor: TensorInfo, mesh: LogicalMesh,
    price_slice: frozenset[int] = frozenset(),
    steps_cache: dict[tuple[ShardingSpec, ShardingSpec], ReshardSteps] | None = None,
) -> ReshardCost:
    """Cost of turning ``tensor`` laid out as ``src`` into ``dst`` on ``mesh`` (a slice:
    free, or ``slice_time_s`` where it splits a dimension of ``price_slice``).
    ``steps_cache``: ``reshard_steps`` by spec pair, kept by the caller for this mesh."""
    if src == dst or tensor.ndim == 0:
        return FREE
    if src.ndim != tensor.ndim or dst.ndim != tensor.ndim:
        raise ValueError(f"spec rank mismatch for tensor of shape {tensor.shape}: {src} -> {dst}")
    steps = None if steps_cache is None else steps_cache.get((src, dst))
    if steps is None:
        steps = reshard_steps(src, dst, mesh)
        if steps_cache is not None:
            steps_cache[(src, dst)] = steps
    return price_steps(steps, dst, tensor, mesh, price_slice)
