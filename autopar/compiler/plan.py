"""Plan: the complete, plain-data result of compilation, where compiler and runtime meet.

A plan names the method, the mesh, and its stages. Each stage owns a contiguous range of layers,
a submesh of the cluster viewed as a 1-D or 2-D logical mesh, a sharding spec for every input
leaf it reads (parameters, optimizer state, batch) and every output leaf it writes, specs for
chosen intermediate tensors (by flat-program value id), and its estimates. JSON round trip is
lossless and versioned; plans are never pickled.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.compiler.collectives import CollectiveEstimate
from autopar.errors import PlanError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShardingSpec:
    """How a tensor is split: for each tensor dimension, the mesh axes that split it.

    ``dims[d] == ()`` means dimension ``d`` is whole on every device; ``("x", "y")`` means it is
    split over both mesh axes (x major). A mesh axis appears at most once per spec.
    """

    dims: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        used = [a for axes in self.dims for a in axes]
        if len(used) != len(set(used)):
            raise PlanError(f"sharding spec {self.dims} uses a mesh axis twice")

    @classmethod
    def replicated(cls, ndim: int) -> ShardingSpec:
        return cls(tuple(() for _ in range(ndim)))

    @classmethod
    def split(cls, ndim: int, dim: int, axes: tuple[str, ...]) -> ShardingSpec:
        """Dimension ``dim`` split over ``axes``; every other dimension whole."""
        return cls(tuple(tuple(axes) if d == dim else () for d in range(ndim)))

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return all(not axes for axes in self.dims)

    def num_shards(self, axis_sizes: dict[str, int]) -> int:
        """How many pieces the tensor is cut into on a mesh with these axis sizes."""
        count = 1
        for axes in self.dims:
            for a in axes:
                count *= axis_sizes[a]
        return count

    def to_string(self) -> str:
        """PartitionSpec notation: ``P('x', None)``, ``P(('x', 'y'),)``, ``P()`` for a scalar."""
        parts = []
        for axes in self.dims:
            if not axes:
                parts.append("None")
            elif len(axes) == 1:
                parts.append(repr(axes[0]))
            else:
                parts.append("(" + ", ".join(repr(a) for a in axes) + ")")
        if len(parts) == 1:
            return f"P({parts[0]},)" if parts[0].startswith("(") else f"P({parts[0]})"
        return "P(" + ", ".join(parts) + ")"

    @classmethod
    def from_string(cls, text: str) -> ShardingSpec:
        """Parse :meth:`to_string`'s notation back."""
        m = re.fullmatch(r"\s*P\((.*)\)\s*", text)
        if not m:
            raise PlanError(f"invalid sharding spec {text!r}; expected P(...) notation")
        body = m.group(1).strip().rstrip(",").strip()
        if not body:
            return cls(())
        dims: list[tuple[str, ...]] = []
        for token in re.findall(r"\([^)]*\)|[^,]+", body):
            token = token.strip()
            if token == "None":
                dims.append(())
            elif token.startswith("("):
                dims.append(tuple(re.findall(r"'([^']*)'", token)))
            else:
                dims.append((token.strip("'\""),))
        return cls(tuple(dims))

    def to_json(self) -> list[list[str]]:
        return [list(axes) for axes in self.dims]

    @classmethod
    def from_json(cls, data: list[list[str]]) -> ShardingSpec:
        return cls(tuple(tuple(axes) for axes in data))


def _use_key(text: str) -> tuple[int, int]:
    node, operand = text.split(":")
    return int(node), int(operand)


def _specs_to_json(specs: dict[Any, ShardingSpec]) -> dict[str, list[list[str]]]:
    return {str(k): v.to_json() for k, v in specs.items()}


@dataclass
class StagePlan:
    """One pipeline stage (a single stage covers the whole step for non-pipelined methods)."""

    index: int
    layers: tuple[int, ...]
    submesh_shape: tuple[int, int]  # (hosts, devices per host)
    logical_mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_ids: tuple[int, ...]  # row-major over the logical mesh
    input_shardings: dict[str, ShardingSpec] = field(default_factory=dict)
    output_shardings: dict[str, ShardingSpec] = field(default_factory=dict)
    tensor_shardings: dict[int, ShardingSpec] = field(default_factory=dict)
    # (node id, operand position) -> the spec that use needs, where it differs from the
    # producer's: the runtime constrains the tensor twice, so XLA reshards exactly there.
    operand_shardings: dict[tuple[int, int], ShardingSpec] = field(default_factory=dict)
    collectives: list[CollectiveEstimate] = field(default_factory=list)
    est_time_s: float = 0.0
    est_compute_time_s: float = 0.0
    est_communication_time_s: float = 0.0
    peak_memory_bytes: int = 0
    memory_breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.logical_mesh_shape, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": list(self.layers),
            "submesh_shape": list(self.submesh_shape),
            "logical_mesh_shape": list(self.logical_mesh_shape),
            "axis_names": list(self.axis_names),
            "device_ids": list(self.device_ids),
            "input_shardings": _specs_to_json(self.input_shardings),
            "output_shardings": _specs_to_json(self.output_shardings),
            "tensor_shardings": _specs_to_json(self.tensor_shardings),
            "operand_shardings": {
                f"{n}:{k}": v.to_json() for (n, k), v in self.operand_shardings.items()
            },
            "collectives": [c.to_dict() for c in self.collectives],
            "est_time_s": self.est_time_s,
            "est_compute_time_s": self.est_compute_time_s,
            "est_communication_time_s": self.est_communication_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_breakdown": dict(self.memory_breakdown),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StagePlan:
        specs = ShardingSpec.from_json
        return cls(
            index=int(d["index"]),
            layers=tuple(d["layers"]),
            submesh_shape=tuple(d["submesh_shape"]),
            logical_mesh_shape=tuple(d["logical_mesh_shape"]),
            axis_names=tuple(d["axis_names"]),
            device_ids=tuple(d["device_ids"]),
            input_shardings={k: specs(v) for k, v in d["input_shardings"].items()},
            output_shardings={k: specs(v) for k, v in d["output_shardings"].items()},
            tensor_shardings={int(k): specs(v) for k, v in d["tensor_shardings"].items()},
            operand_shardings={
                _use_key(k): specs(v) for k, v in d.get("operand_shardings", {}).items()
            },
            collectives=[CollectiveEstimate.from_dict(c) for c in d["collectives"]],
            est_time_s=float(d["est_time_s"]),
            est_compute_time_s=float(d["est_compute_time_s"]),
            est_communication_time_s=float(d["est_communication_time_s"]),
            peak_memory_bytes=int(d["peak_memory_bytes"]),
            memory_breakdown={k: int(v) for k, v in d["memory_breakdown"].items()},
        )


@dataclass(frozen=True)
class InputSignature:
    """Path, shape and dtype of one input leaf: what a plan was made for."""

    path: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Plan:
    """A complete parallelization plan for one train step and one input signature."""

    method: str
    mesh_shape: tuple[int, ...]
    cluster: str
    stages: list[StagePlan]
    est_step_time_s: float
    total_flops: float
    signature: list[InputSignature] = field(default_factory=list)
    batch_argnums: tuple[int, ...] = (1,)
    num_microbatches: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    solver: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    @property
    def peak_memory_bytes(self) -> int:
        """Per-device peak memory: the largest over stages."""
        return max((s.peak_memory_bytes for s in self.stages), default=0)

    def shardings(self) -> dict[str, str]:
        """Every input leaf's path -> spec string (parameters, optimizer state, batch)."""
        out: dict[str, str] = {}
        for stage in self.stages:
            for path, spec in stage.input_shardings.items():
                out.setdefault(path, spec.to_string())
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "method": self.method,
            "mesh_shape": list(self.mesh_shape),
            "cluster": self.cluster,
            "stages": [s.to_dict() for s in self.stages],
            "est_step_time_s": self.est_step_time_s,
            "total_flops": self.total_flops,
            "signature": [asdict(s) | {"shape": list(s.shape)} for s in self.signature],
            "batch_argnums": list(self.batch_argnums),
            "num_microbatches": self.num_microbatches,
            "options": dict(self.options),
            "solver": self.solver,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise PlanError(
                f"plan format version {version!r} is not supported; "
                f"this autopar reads version {FORMAT_VERSION}"
            )
        try:
            return cls(
                method=d["method"],
                mesh_shape=tuple(d["mesh_shape"]),
                cluster=d["cluster"],
                stages=[StagePlan.from_dict(s) for s in d["stages"]],
                est_step_time_s=float(d["est_step_time_s"]),
                total_flops=float(d["total_flops"]),
                signature=[
                    InputSignature(s["path"], tuple(s["shape"]), s["dtype"])
                    for s in d["signature"]
                ],
                batch_argnums=tuple(d["batch_argnums"]),
                num_microbatches=int(d["num_microbatches"]),
                options=dict(d["options"]),
                solver=d["solver"],
                notes=list(d["notes"]),
                format_version=version,
            )
        except KeyError as exc:
            raise PlanError(f"plan is missing the field {exc.args[0]!r}") from exc

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (a reader never sees half a file)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(self.to_json())
        os.replace(tmp, target)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PlanError(f"cannot read plan file {str(path)!r}: {exc.strerror}") from exc
        return cls.from_json(text)
