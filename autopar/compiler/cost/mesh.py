"""The logical meshes the compiler plans for.

A :class:`LogicalMesh` is a 1-D or 2-D view of some of a cluster's devices
(:class:`autopar.cluster.ClusterSpec`). Each mesh axis has its own alpha (latency per message,
s) and beta (s per byte): an axis whose device groups span more than one host gets the
inter-host link, otherwise the intra-host link. The collective cost model
(:mod:`autopar.compiler.cost.collectives`) reads only these numbers.

Nothing here touches devices or imports JAX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from autopar.cluster import ClusterSpec, DeviceSpec, format_mesh_shape, parse_mesh_shape
from autopar.errors import MeshError, choices_text

__all__ = ["LogicalMesh"]

_FALLBACK_DTYPE = "float32"


def _check_shape(shape: tuple[int, ...]) -> None:
    text = format_mesh_shape(shape)
    if not 1 <= len(shape) <= 2:
        raise MeshError(
            f"mesh shape {text} has {len(shape)} dimensions; only 1-D and 2-D meshes are "
            "supported")
    if any(not isinstance(d, int | np.integer) or d < 1 for d in shape):
        raise MeshError(f"mesh shape {text} has a non-positive dimension")


@dataclass(frozen=True)
class LogicalMesh:
    """A 1-D or 2-D logical view of physical devices, with alpha/beta per axis.

    ``device_ids`` lists physical device indices row-major over ``shape``. An empty
    ``axis_names`` gets the defaults ``("x",)`` or ``("x", "y")``.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_ids: tuple[int, ...]
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    device: DeviceSpec
    compute_efficiency: float

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        _check_shape(shape)
        text = format_mesh_shape(shape)
        names = tuple(self.axis_names) or ("x", "y")[: len(shape)]
        ids = tuple(int(i) for i in self.device_ids)
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise MeshError(f"mesh shape {text} needs {len(shape)} distinct axis names, "
                            f"got {names}")
        if len(ids) != math.prod(shape):
            raise MeshError(f"mesh shape {text} needs {math.prod(shape)} devices but "
                            f"{len(ids)} device ids were given")
        if len(set(ids)) != len(ids):
            raise MeshError(f"mesh shape {text}: device ids {ids} contain duplicates")
        if len(self.alpha) != len(shape) or len(self.beta) != len(shape):
            raise MeshError(f"mesh shape {text} needs one alpha and one beta per axis, got "
                            f"{len(self.alpha)} and {len(self.beta)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "alpha", tuple(float(a) for a in self.alpha))
        object.__setattr__(self, "beta", tuple(float(b) for b in self.beta))

    @classmethod
    def from_cluster(
        cls,
        cluster: ClusterSpec,
        shape: Sequence[int] | str,
        device_ids: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
    ) -> LogicalMesh:
        """View ``device_ids`` (default: the first ``prod(shape)`` devices) of ``cluster``."""
        dims = parse_mesh_shape(shape) if isinstance(shape, str) else tuple(int(d) for d in shape)
        _check_shape(dims)
        text, need = format_mesh_shape(dims), math.prod(dims)
        if need > cluster.num_devices:
            raise MeshError(f"mesh shape {text} needs {need} devices but cluster "
                            f"'{cluster.name}' has {cluster.num_devices}")
        ids = tuple(range(need)) if device_ids is None else tuple(int(i) for i in device_ids)
        if len(ids) != need:
            raise MeshError(f"mesh shape {text} needs {need} devices but {len(ids)} device ids "
                            "were given")
        bad = [i for i in ids if not 0 <= i < cluster.num_devices]
        if bad:
            raise MeshError(f"device ids {bad} are outside cluster '{cluster.name}' "
                            f"(devices 0..{cluster.num_devices - 1})")
        hosts = np.array([cluster.host_of(i) for i in ids]).reshape(dims)
        alpha, beta = [], []
        for axis in range(len(dims)):
            groups = np.moveaxis(hosts, axis, -1).reshape(-1, dims[axis])
            spans_hosts = bool((groups != groups[:, :1]).any())
            link = cluster.inter_host if spans_hosts else cluster.intra_host
            alpha.append(link.alpha)
            beta.append(link.beta)
        return cls(shape=dims, axis_names=tuple(axis_names or ()), device_ids=ids,
                   alpha=tuple(alpha), beta=tuple(beta), device=cluster.device,
                   compute_efficiency=cluster.compute_efficiency)

    @property
    def ndim(self) -> int:
        """Number of mesh axes (1 or 2)."""
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        """Number of devices in the mesh."""
        return math.prod(self.shape)

    def axis_size(self, axis: int | str) -> int:
        """Size of a mesh axis given by index or name."""
        size = self._named_sizes.get(axis) if isinstance(axis, str) else None
        return self.shape[self._axis(axis)] if size is None else size

    def axis_index(self, name: str) -> int:
        """Index of the axis called ``name``."""
        if name not in self.axis_names:
            raise MeshError(f"unknown mesh axis '{name}'; valid axes: "
                            f"{choices_text(self.axis_names)}")
        return self.axis_names.index(name)

    @cached_property
    def _named_sizes(self) -> dict[str, int]:
        # a strategy build asks an axis's size by name hundreds of thousands of times
        return dict(zip(self.axis_names, self.shape, strict=True))

    def _axis(self, axis: int | str) -> int:
        if isinstance(axis, str):
            return self.axis_index(axis)
        if not -self.ndim <= axis < self.ndim:
            raise MeshError(f"mesh axis {axis} out of range for a {self.ndim}-D mesh")
        return axis % self.ndim

    def device_grid(self) -> np.ndarray:
        """Physical device ids as an integer array of the mesh's shape."""
        return np.asarray(self.device_ids, dtype=np.int64).reshape(self.shape)

    @property
    def peak_flops(self) -> float:
        """float32 peak flop/s of one device (see :meth:`DeviceSpec.flops_for`)."""
        return self.device.flops_for(_FALLBACK_DTYPE)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "device_ids": list(self.device_ids),
            "alpha": list(self.alpha),
            "beta": list(self.beta),
            "device": self.device.to_dict(),
            "compute_efficiency": self.compute_efficiency,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LogicalMesh:
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(
                shape=tuple(data["shape"]),
                axis_names=tuple(data.get("axis_names", ())),
                device_ids=tuple(data["device_ids"]),
                alpha=tuple(data["alpha"]),
                beta=tuple(data["beta"]),
                device=DeviceSpec.from_dict(data["device"], "device."),
                compute_efficiency=float(data["compute_efficiency"]),
            )
        except KeyError as err:
            raise MeshError(f"logical mesh is missing field {err}") from None


def mesh_shape_choices(num_devices: int) -> list[str]:
    """Valid 1-D and 2-D mesh shapes for ``num_devices`` devices, for error messages."""
    shapes = [str(num_devices)]
    shapes += [f"{a}x{num_devices // a}" for a in range(1, num_devices + 1) if num_devices % a == 0]
    return shapes


def logical_mesh_for(cluster: ClusterSpec, mesh_shape: tuple[int, ...] | None) -> LogicalMesh:
    """The logical mesh over the whole cluster (default: one axis over all its devices)."""
    n = cluster.num_devices
    shape = tuple(mesh_shape) if mesh_shape else (n,)
    count = 1
    for d in shape:
        count *= d
    if count != n:
        raise MeshError(
            f"mesh shape {format_mesh_shape(shape)} covers {count} devices but the cluster "
            f"'{cluster.name}' has {n}; valid shapes: {', '.join(mesh_shape_choices(n))}"
        )
    return LogicalMesh.from_cluster(cluster, shape)
