"""Step-time and memory estimates shared by every planning method."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from autopar.cluster import RuntimeCosts
from autopar.compiler.cost.collectives import collective_time
from autopar.compiler.cost.gemm import described_gemm_time_s, dot_efficiency
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.fusion import kernel_bytes, kernel_launches
from autopar.compiler.graph.opgraph import OpGraph, OpNode
from autopar.plan import CollectiveEstimate, CollectiveKind


def dominant_float_dtype(graph: OpGraph) -> str:
    """The floating dtype carrying most flops' operands: the one whose peak rate applies."""
    weights: defaultdict[str, float] = defaultdict(float)
    for node in graph.nodes:
        if node.flops and node.outputs:
            weights[graph.tensors[node.outputs[0]].dtype] += node.flops
    floats = [(w, d) for d, w in weights.items() if "float" in d]
    return max(floats)[1] if floats else "float32"


def compute_time_s(flops_per_device: float, mesh: LogicalMesh, dtype: str) -> float:
    """Seconds to run ``flops_per_device`` at the device's peak rate times its efficiency."""
    rate = mesh.device.flops_for(dtype) * mesh.compute_efficiency
    return flops_per_device / rate


def summarize_collectives(
    implied: Iterable[tuple[CollectiveKind, int]], mesh: LogicalMesh, axes: tuple[int, ...]
) -> list[CollectiveEstimate]:
    """Group individual collectives (kind, bytes) into one estimate per kind on ``axes``."""
    totals: dict[CollectiveKind, list[float]] = {}
    for kind, nbytes in implied:
        entry = totals.setdefault(kind, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += collective_time(kind, nbytes, mesh, axes)
    return [
        CollectiveEstimate(kind=k, count=int(c), nbytes=b, axes=axes, time_s=t)
        for k, (c, b, t) in sorted(totals.items(), key=lambda kv: kv[0].value)
    ]


def roofline_time_s(flops: float, nbytes: float, mesh: LogicalMesh, dtype: str,
                    shape_efficiency: float = 1.0, gemm: bool = False) -> float:
    """Seconds of a kernel that does ``flops`` and moves ``nbytes`` on one device: the slower
    of its flops at the device's peak for ``dtype`` times its efficiency (and times
    ``shape_efficiency``: a GEMM's wave quantization, ``cost.gemm``) and its bytes at the
    device's memory bandwidth (flops alone where the cluster does not describe it). A
    ``gemm`` on a device that describes its GEMM rate runs at the faster of that and the
    general rate (``gemm.described_gemm_time_s``)."""
    seconds = flops / (mesh.device.flops_for(dtype) * mesh.compute_efficiency
                       * shape_efficiency)
    if gemm and (described := described_gemm_time_s(flops, mesh.device, dtype)) is not None:
        seconds = min(seconds, described)
    bandwidth = mesh.device.memory_bandwidth_bytes_per_s
    return max(seconds, nbytes / bandwidth) if bandwidth > 0 else seconds


def node_compute_time_s(graph: OpGraph, node: OpNode, mesh: LogicalMesh, parts: int) -> float:
    """Seconds of one node split ``parts`` ways: its flops at the rate of its result's dtype
    and its kernel's bytes (``graph.fusion``) at the memory bandwidth, the slower (as the
    intra-operator strategies price a node: ``StrategyContext.compute_time``); a dot at its
    GEMM's wave efficiency with the batch split (``gemm.dot_efficiency``); and the fixed
    seconds of the kernels it starts (``device.kernel_launch_s``)."""
    dtype = graph.tensors[node.outputs[0]].dtype if node.outputs else "float32"
    nbytes = kernel_bytes(graph, node) if mesh.device.memory_bandwidth_bytes_per_s else 0.0
    launched = launch_time_s(graph, mesh, nodes=(node,))
    if not node.flops and not nbytes:
        return launched
    share = max(parts, 1)
    shape = 1.0
    if node.primitive == "dot_general" and len(node.inputs) == 2 and mesh.device.multiprocessors:
        lhs, rhs = (graph.tensors[t].shape for t in node.inputs)
        shape = dot_efficiency(lhs, rhs, node.params["dimension_numbers"], share,
                               mesh.device.multiprocessors)
    return roofline_time_s(node.flops / share, nbytes / share, mesh, dtype, shape,
                           gemm=node.primitive == "dot_general") + launched


def launch_time_s(graph: OpGraph, mesh: LogicalMesh, skip: Collection[int] = (),
                  nodes: Iterable[OpNode] | None = None) -> float:
    """Seconds of the launches of every kernel ``graph`` starts (or ``nodes`` of it; but the
    nodes ``skip``) on one device of ``mesh``: the same under every plan, so the ILP leaves
    them out (a constant would only loosen its relative gap) and its estimates add them."""
    launch = mesh.device.kernel_launch_s
    if not launch:
        return 0.0
    return launch * sum(kernel_launches(graph, node)
                        for node in (graph.nodes if nodes is None else nodes)
                        if node.id not in skip)


def split_compute_time_s(graph: OpGraph, mesh: LogicalMesh,
                         parts: Callable[[OpNode], int]) -> float:
    """Compute seconds of every node, each split ``parts(node)`` ways: a one-stage planner that
    splits some nodes (the batch's) and repeats the others on every device (the replicated
    update of data parallelism) costs both as they run."""
    return math.fsum(node_compute_time_s(graph, node, mesh, parts(node)) for node in graph.nodes)


def touched_by(graph: OpGraph, tensors: Collection[int]) -> Callable[[OpNode], bool]:
    """Whether a node reads or writes any of ``tensors`` (the split ones, say)."""
    def touches(node: OpNode) -> bool:
        return any(t in tensors for t in node.inputs) or any(t in tensors for t in node.outputs)
    return touches


@dataclass(frozen=True)
class CallArrays:
    """The arrays a step's call takes in and hands back (``arrays``), and of its inputs those
    that arrive from the host at every call (``fed``: the batch's)."""

    arrays: int
    fed: int = 0


def call_arrays(graph: OpGraph, batch_argnums: Collection[int]) -> CallArrays:
    """A step's arrays in and out, its batch arguments' leaves fed."""
    fed = sum(1 for io in graph.inputs if io.arg_index in batch_argnums)
    return CallArrays(len(graph.inputs) + len(graph.outputs), fed)


def one_call_time_s(runtime: RuntimeCosts, call: CallArrays, devices_on_host: int) -> float:
    """What the runtime adds to a step run as one call of one jitted program: the call, each
    device buffer it takes in and hands back, and each device's piece of every array fed from
    the host (each array on each of the ``devices_on_host`` devices one host's process
    drives)."""
    per_device = runtime.buffer_s * call.arrays + runtime.feed_s * call.fed
    return runtime.call_s + per_device * max(1, devices_on_host)
