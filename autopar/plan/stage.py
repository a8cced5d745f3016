"""One pipeline stage of a plan (one stage covers the whole step for non-pipelined methods)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import PlanError
from autopar.plan.fields import (
    JsonField,
    dump_fields,
    is_int,
    listed,
    load_fields,
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
    # a pipeline stage's: the spec of each forward value's cotangent in the backward, where
    # it is not the value's own (the runtime holds the backward to it)
    cotangent_shardings: dict[int, ShardingSpec] = field(default_factory=dict)
    # a pipeline stage's: where its plan reads a contraction's operands otherwise than they
    # come, keyed "equation:operand:role" (``ir.cotangent_marks``: "in" as the forward reads
    # it; "ct", "other" as the transpose making that operand's gradient reads them)
    contraction_shardings: dict[str, ShardingSpec] = field(default_factory=dict)
    # (node id, operand position) -> the spec that use needs, where it differs from the
    # producer's: the runtime constrains the tensor twice, so XLA reshards exactly there.
    operand_shardings: dict[tuple[int, int], ShardingSpec] = field(default_factory=dict)
    collectives: list[CollectiveEstimate] = field(default_factory=list)
    est_time_s: float = 0.0
    est_compute_time_s: float = 0.0
    est_communication_time_s: float = 0.0
    peak_memory_bytes: int = 0
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    # leaves kept in host memory between steps (the optimizer state, ``cost.host_state``):
    # input paths and the output paths carrying their new values
    host_paths: tuple[str, ...] = ()

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.logical_mesh_shape, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return dump_fields(self, STAGE_JSON)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "stages[0]") -> StagePlan:
        """The stage of ``d``, checked (:meth:`check`); ``where`` names it in errors."""
        if not isinstance(d, dict):
            raise PlanError(f"plan field {where} must be an object, got {type(d).__name__}")
        stage = cls(**load_fields(d, STAGE_JSON, where))
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
                            ("cotangent_shardings", self.cotangent_shardings),
                            ("contraction_shardings", self.contraction_shardings),
                            ("operand_shardings", self.operand_shardings)):
            for key, spec in specs.items():
                unknown = [a for dim in spec.dims for a in dim if a not in axes]
                if unknown:
                    label = f"{key[0]}:{key[1]}" if isinstance(key, tuple) else str(key)
                    raise PlanError(f"plan field {where}.{kind}[{label!r}] names mesh axis "
                                    f"{unknown[0]!r}; the stage's axes are {', '.join(names)}")


def _use_keys_json(specs: dict[tuple[int, int], ShardingSpec]) -> dict[str, Any]:
    return {f"{n}:{k}": v.to_json() for (n, k), v in specs.items()}


# StagePlan's JSON form, field by field (``fields.JsonField``)
STAGE_JSON = (
    JsonField("index", int),
    JsonField("layers", tuple, listed),
    JsonField("submesh_shape", tuple, listed),
    JsonField("logical_mesh_shape", tuple, listed),
    JsonField("axis_names", tuple, listed),
    JsonField("device_ids", tuple, listed),
    JsonField("input_shardings", spec_map(str), specs_to_json),
    JsonField("output_shardings", spec_map(str), specs_to_json),
    JsonField("tensor_shardings", spec_map(int), specs_to_json),
    JsonField("cotangent_shardings", spec_map(int), specs_to_json, {}),
    JsonField("contraction_shardings", spec_map(str), specs_to_json, {}),
    JsonField("operand_shardings", spec_map(use_key), _use_keys_json, {}),
    JsonField("collectives", lambda v: [CollectiveEstimate.from_dict(c) for c in v],
              lambda cs: [c.to_dict() for c in cs]),
    JsonField("est_time_s", float),
    JsonField("est_compute_time_s", float),
    JsonField("est_communication_time_s", float),
    JsonField("peak_memory_bytes", int),
    JsonField("memory_breakdown", lambda v: {k: int(x) for k, x in v.items()}, dict),
    JsonField("host_paths", tuple, listed, ()),
)
