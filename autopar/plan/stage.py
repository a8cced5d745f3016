"""One pipeline stage of a plan (one stage covers the whole step for non-pipelined methods)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import PlanError
from autopar.plan.fields import (
    REQUIRED,
    field_of,
    is_int,
    reject_unknown,
    spec_map,
    specs_to_json,
    use_key,
)
from autopar.plan.specs import CollectiveEstimate, ShardingSpec


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
            "input_shardings": specs_to_json(self.input_shardings),
            "output_shardings": specs_to_json(self.output_shardings),
            "tensor_shardings": specs_to_json(self.tensor_shardings),
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

        reject_unknown(d, STAGE_FIELDS, where)

        def get(name: str, convert: Any, default: Any = REQUIRED) -> Any:
            return field_of(d, name, convert, f"{where}.{name}", default)

        stage = cls(
            index=get("index", int),
            layers=get("layers", tuple),
            submesh_shape=get("submesh_shape", tuple),
            logical_mesh_shape=get("logical_mesh_shape", tuple),
            axis_names=get("axis_names", tuple),
            device_ids=get("device_ids", tuple),
            input_shardings=get("input_shardings", spec_map(str)),
            output_shardings=get("output_shardings", spec_map(str)),
            tensor_shardings=get("tensor_shardings", spec_map(int)),
            operand_shardings=get("operand_shardings", spec_map(use_key), {}),
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
        if not shape or not all(is_int(n) and n >= 1 for n in shape):
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
            if not is_int(d):
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


STAGE_FIELDS = tuple(StagePlan.__dataclass_fields__)
