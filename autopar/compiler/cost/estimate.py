"""Step-time and memory estimates shared by every planning method."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from autopar.compiler.cost.collectives import collective_time
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.opgraph import OpGraph
from autopar.plan import CollectiveEstimate, CollectiveKind


def dominant_float_dtype(graph: OpGraph) -> str:
    """The floating dtype carrying most flops' operands: the one whose peak rate applies."""
    weights: Counter[str] = Counter()
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
