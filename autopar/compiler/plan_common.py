"""Pieces every planning method needs to turn its choices into a Plan."""

from __future__ import annotations

from autopar.compiler.graph import OpGraph
from autopar.compiler.mesh import LogicalMesh
from autopar.compiler.plan import InputSignature


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
