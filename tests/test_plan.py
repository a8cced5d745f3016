"""Plan dataclasses: sharding spec notation and the lossless, versioned JSON round trip."""

import json

import pytest

from autopar.errors import PlanError
from autopar.plan import (
    FORMAT_VERSION,
    CollectiveEstimate,
    CollectiveKind,
    InputSignature,
    Plan,
    ShardingSpec,
    StagePlan,
)


def make_plan() -> Plan:
    stage = StagePlan(
        index=0,
        layers=(0, 1, 2),
        submesh_shape=(1, 8),
        logical_mesh_shape=(2, 4),
        axis_names=("x", "y"),
        device_ids=tuple(range(8)),
        input_shardings={
            "state/params/w": ShardingSpec((("y",), ())),
            "batch/x": ShardingSpec((("x", "y"), ())),
            "state/step": ShardingSpec(()),
        },
        output_shardings={"out/1": ShardingSpec(())},
        tensor_shardings={17: ShardingSpec(((), ("y",)))},
        operand_shardings={(5, 1): ShardingSpec((("x",), ()))},
        collectives=[CollectiveEstimate(CollectiveKind.ALL_REDUCE, 3, 1024.0, (0, 1), 1e-4)],
        est_time_s=0.5,
        est_compute_time_s=0.4,
        est_communication_time_s=0.1,
        peak_memory_bytes=123456,
        memory_breakdown={"state": 100000, "activations": 23456},
    )
    return Plan(
        method="data",
        mesh_shape=(2, 4),
        cluster="cpu-sim",
        stages=[stage],
        est_step_time_s=0.5,
        total_flops=1.5e9,
        signature=[InputSignature("batch/x", (16, 8), "float32")],
        options={"mesh_shape": [2, 4]},
        solver={"status": "Optimal", "objective": 1.25},
        notes=["a note"],
    )


def test_json_round_trip_is_lossless(tmp_path):
    plan = make_plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    path = tmp_path / "sub" / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    data = json.loads(path.read_text())
    assert data["format_version"] == FORMAT_VERSION
    assert not list(tmp_path.glob("sub/*.tmp"))


@pytest.mark.parametrize(
    "spec, text",
    [
        (ShardingSpec(()), "P()"),
        (ShardingSpec(((),)), "P(None)"),
        (ShardingSpec((("x",),)), "P('x')"),
        (ShardingSpec((("x", "y"),)), "P(('x', 'y'),)"),
        (ShardingSpec((("x",), (), ("y",))), "P('x', None, 'y')"),
        (ShardingSpec((("x", "y"), ())), "P(('x', 'y'), None)"),
    ],
)
def test_spec_string_notation(spec, text):
    assert spec.to_string() == text
    assert ShardingSpec.from_string(text) == spec


def test_spec_helpers():
    spec = ShardingSpec.split(3, 1, ("x", "y"))
    assert spec.dims == ((), ("x", "y"), ())
    assert spec.num_shards({"x": 2, "y": 4}) == 8
    assert ShardingSpec.replicated(2).is_replicated
    with pytest.raises(PlanError, match="twice"):
        ShardingSpec((("x",), ("x",)))


def test_wrong_version_and_bad_json_are_plan_errors(tmp_path):
    data = make_plan().to_dict()
    data["format_version"] = 99
    with pytest.raises(PlanError, match="version 99"):
        Plan.from_dict(data)
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{nope")
    del data["stages"]
    data["format_version"] = FORMAT_VERSION
    with pytest.raises(PlanError, match="'stages'"):
        Plan.from_dict(data)
    with pytest.raises(PlanError, match="cannot read plan file"):
        Plan.load(tmp_path / "missing.json")
