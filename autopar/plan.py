"""Plan: the complete, plain-data result of compilation, where compiler and runtime meet.

A plan names the method, the mesh, and its stages. Each stage owns a contiguous range of layers,
a submesh of the cluster viewed as a 1-D or 2-D logical mesh, a sharding spec for every input
leaf it reads (parameters, optimizer state, batch) and every output leaf it writes, specs for
chosen intermediate tensors (by flat-program value id), and its estimates. JSON round trip is
lossless and versioned; plans are never pickled.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from autopar.errors import InvalidOptionError, PlanError, choices_text

FORMAT_VERSION = 1


class CollectiveKind(StrEnum):
    """Collective operations; values are the HLO opcode names."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"


def collective_kind(kind: CollectiveKind | str) -> CollectiveKind:
    """``kind`` as a :class:`CollectiveKind` (InvalidOptionError naming the valid ones)."""
    try:
        return CollectiveKind(kind)
    except ValueError:
        raise InvalidOptionError(
            f"unknown collective '{kind}'; valid collectives: "
            f"{choices_text(k.value for k in CollectiveKind)}") from None


@dataclass(frozen=True)
class CollectiveEstimate:
    """A predicted collective: ``count`` occurrences of ``kind`` moving ``nbytes`` (the
    full-tensor convention of ``autopar.compiler.cost.collectives``) over mesh ``axes``;
    ``time_s`` is the total for all ``count``."""

    kind: CollectiveKind
    count: int
    nbytes: float
    axes: tuple[int, ...]
    time_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", collective_kind(self.kind))
        object.__setattr__(self, "axes", tuple(int(a) for a in self.axes))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"kind": self.kind.value, "count": self.count, "nbytes": self.nbytes,
                "axes": list(self.axes), "time_s": self.time_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CollectiveEstimate:
        """Inverse of :meth:`to_dict`."""
        return cls(kind=collective_kind(data["kind"]), count=int(data["count"]),
                   nbytes=float(data["nbytes"]), axes=tuple(data["axes"]),
                   time_s=float(data["time_s"]))


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


_REQUIRED = object()


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a string, got {type(value).__name__}")
    return value


def _spec_map(key: Any) -> Any:
    """A converter of ``{key: spec JSON}`` to ``{key(k): ShardingSpec}``."""
    def convert(value: Any) -> dict[Any, ShardingSpec]:
        if not isinstance(value, dict):
            raise TypeError(f"an object of sharding specs, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            try:
                out[key(k)] = ShardingSpec.from_json(v)
            except PlanError as exc:  # a spec that uses an axis twice: name its key
                raise ValueError(f"[{k!r}] {exc}") from None
        return out
    return convert


def _field(d: dict[str, Any], name: str, convert: Any, label: str,
           default: Any = _REQUIRED) -> Any:
    """``convert(d[name])``; a missing field or one ``convert`` refuses is a one-line
    ``PlanError`` naming ``label`` (its place in the plan: ``stages[0].device_ids``)."""
    if name not in d:
        if default is _REQUIRED:
            raise PlanError(f"plan is missing the field {label!r}")
        return default
    try:
        return convert(d[name])
    except PlanError:
        raise  # a nested field's own error (a stage's) names that field
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise PlanError(f"plan field {label} is invalid ({type(exc).__name__}: {reason})") \
            from None


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
    def from_dict(cls, d: dict[str, Any], where: str = "stages[0]") -> StagePlan:
        """The stage of ``d``, checked (:meth:`check`); ``where`` names it in errors."""
        if not isinstance(d, dict):
            raise PlanError(f"plan field {where} must be an object, got {type(d).__name__}")

        def get(name: str, convert: Any, default: Any = _REQUIRED) -> Any:
            return _field(d, name, convert, f"{where}.{name}", default)

        stage = cls(
            index=get("index", int),
            layers=get("layers", tuple),
            submesh_shape=get("submesh_shape", tuple),
            logical_mesh_shape=get("logical_mesh_shape", tuple),
            axis_names=get("axis_names", tuple),
            device_ids=get("device_ids", tuple),
            input_shardings=get("input_shardings", _spec_map(str)),
            output_shardings=get("output_shardings", _spec_map(str)),
            tensor_shardings=get("tensor_shardings", _spec_map(int)),
            operand_shardings=get("operand_shardings", _spec_map(_use_key), {}),
            collectives=get("collectives",
                            lambda v: [CollectiveEstimate.from_dict(c) for c in v]),
            est_time_s=get("est_time_s", float),
            est_compute_time_s=get("est_compute_time_s", float),
            est_communication_time_s=get("est_communication_time_s", float),
            peak_memory_bytes=get("peak_memory_bytes", int),
            memory_breakdown=get("memory_breakdown", lambda v: {k: int(x) for k, x in v.items()}),
        )
        stage.check(where)
        return stage

    def check(self, where: str = "stages[0]") -> None:
        """``PlanError`` (one line naming the field) unless the stage is consistent: a logical
        mesh of positive sizes with one axis name each, as many distinct non-negative device
        ids as the mesh has places, and sharding specs naming only the stage's axes."""
        shape, names = self.logical_mesh_shape, self.axis_names
        if not shape or not all(_is_int(n) and n >= 1 for n in shape):
            raise PlanError(f"plan field {where}.logical_mesh_shape {list(shape)} must be one "
                            "or more positive integers")
        if not all(isinstance(a, str) for a in names) or len(set(names)) != len(names):
            raise PlanError(f"plan field {where}.axis_names {list(names)} must be distinct "
                            "strings")
        if len(names) != len(shape):
            raise PlanError(f"plan field {where}.axis_names has {len(names)} name(s) for the "
                            f"{len(shape)}-D logical_mesh_shape {list(shape)}")
        ids = self.device_ids
        if not ids:
            raise PlanError(f"plan field {where}.device_ids is empty; a stage needs at least "
                            "one device")
        for d in ids:
            if not _is_int(d):
                raise PlanError(f"plan field {where}.device_ids holds {d!r}; device ids are "
                                "integers")
            if d < 0:
                raise PlanError(f"plan field {where}.device_ids holds {d}; device ids are 0 "
                                "or more")
        if len(set(ids)) != len(ids):
            twice = next(d for d in ids if ids.count(d) > 1)
            raise PlanError(f"plan field {where}.device_ids names device {twice} more than once")
        places = math.prod(shape)
        if len(ids) != places:
            raise PlanError(f"plan field {where}.device_ids has {len(ids)} device(s) but the "
                            f"logical_mesh_shape {list(shape)} has {places} places")
        axes = set(names)
        for kind, specs in (("input_shardings", self.input_shardings),
                            ("output_shardings", self.output_shardings),
                            ("tensor_shardings", self.tensor_shardings),
                            ("operand_shardings", self.operand_shardings)):
            for key, spec in specs.items():
                unknown = [a for dim in spec.dims for a in dim if a not in axes]
                if unknown:
                    label = f"{key[0]}:{key[1]}" if isinstance(key, tuple) else str(key)
                    raise PlanError(f"plan field {where}.{kind}[{label!r}] names mesh axis "
                                    f"{unknown[0]!r}; the stage's axes are {', '.join(names)}")


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
        """The plan of ``d`` (``Plan.to_dict``'s form), checked (:meth:`check`): a missing,
        mistyped or inconsistent field is a one-line ``PlanError`` naming it."""
        if not isinstance(d, dict):
            raise PlanError(f"a plan is a JSON object, got {type(d).__name__}")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise PlanError(
                f"plan format version {version!r} is not supported; "
                f"this autopar reads version {FORMAT_VERSION}"
            )

        def get(name: str, convert: Any) -> Any:
            return _field(d, name, convert, name)

        def stages(value: Any) -> list[StagePlan]:
            if not isinstance(value, list):
                raise TypeError(f"a list of stages, got {type(value).__name__}")
            return [StagePlan.from_dict(s, f"stages[{i}]") for i, s in enumerate(value)]

        plan = cls(
            method=get("method", _string),
            mesh_shape=get("mesh_shape", tuple),
            cluster=get("cluster", _string),
            stages=get("stages", stages),
            est_step_time_s=get("est_step_time_s", float),
            total_flops=get("total_flops", float),
            signature=get("signature", lambda v: [
                InputSignature(s["path"], tuple(s["shape"]), s["dtype"]) for s in v]),
            batch_argnums=get("batch_argnums", tuple),
            num_microbatches=get("num_microbatches", int),
            options=get("options", dict),
            solver=get("solver", lambda v: v),
            notes=get("notes", list),
            format_version=version,
        )
        plan.check()
        return plan

    def check(self) -> None:
        """``PlanError`` (one line naming the field) unless the plan is consistent in itself:
        every stage (:meth:`StagePlan.check`), at least one stage, a positive number of
        microbatches, and every input spec fitting the shape the plan's signature gives that
        input (as many dimensions, each split into pieces that divide it)."""
        if not self.stages:
            raise PlanError("plan field stages is empty; a plan has at least one stage")
        if not _is_int(self.num_microbatches) or self.num_microbatches < 1:
            raise PlanError(f"plan field num_microbatches={self.num_microbatches!r} must be a "
                            "positive integer")
        shapes = {s.path: tuple(s.shape) for s in self.signature}
        for i, stage in enumerate(self.stages):
            stage.check(f"stages[{i}]")
            sizes = stage.axis_sizes
            for path, spec in stage.input_shardings.items():
                shape = shapes.get(path)
                if shape is None:
                    continue
                field_name = f"stages[{i}].input_shardings[{path!r}]"
                if spec.ndim != len(shape):
                    raise PlanError(f"plan field {field_name} has {spec.ndim} dimension(s) but "
                                    f"the signature gives {path!r} the shape {list(shape)}")
                for dim, (size, axes) in enumerate(zip(shape, spec.dims, strict=True)):
                    pieces = math.prod(sizes[a] for a in axes)
                    if _is_int(size) and size % pieces:
                        raise PlanError(
                            f"plan field {field_name} splits dimension {dim} (size {size}) into "
                            f"{pieces} pieces over mesh axes {', '.join(axes)}; they must "
                            "divide it")

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
