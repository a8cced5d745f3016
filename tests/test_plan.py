"""Plan dataclasses: sharding spec notation and the lossless, versioned JSON round trip."""

import dataclasses
import json

import pytest

from autopar.errors import PlanError
from autopar.plan import (
    FORMAT_VERSION,
    CollectiveEstimate,
    CollectiveKind,
    InputSignature,
    MethodName,
    PipelineLayout,
    Plan,
    PlanningRecord,
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
        planning=PlanningRecord(planning_time_s=0.25, method_options={"mesh_shape": [2, 4]}),
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


# ---- the typed contract: real fields, strict JSON, version 1 read ---------------------------


def pipelined_plan() -> Plan:
    stages = []
    for i in range(2):
        stages.append(StagePlan(index=i, layers=(i,), submesh_shape=(1, 4),
                                logical_mesh_shape=(4,), axis_names=("x",),
                                device_ids=tuple(range(4 * i, 4 * i + 4))))
    layout = PipelineLayout(schedule="1f1b", num_chunks=1, layer_positions=(10, 20, 30),
                            piece_positions=(20,), stage_of_piece=(0, 1),
                            remat_stages=(False, True))
    return Plan(method=MethodName.PIPESHARD, mesh_shape=(2,), cluster="cpu-sim", stages=stages,
                est_step_time_s=1.0, total_flops=2.0, num_microbatches=4, pipeline=layout,
                planning=PlanningRecord(phases={"total_s": 0.5}, stage_search={"gap": 0.0},
                                        estimated_idle_fraction=0.2))


def test_the_fields_the_runtime_reads_are_typed_and_round_trip():
    plan = pipelined_plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.method is MethodName.PIPESHARD and again.is_pipelined
    assert again.pipeline.stage_of_piece == (0, 1) and again.pipeline.remat_stages == (False, True)
    blocks = dataclasses.replace(plan, pipeline=dataclasses.replace(
        plan.pipeline, checkpoint_positions=(5, 10, 15, 20, 25, 30)))
    assert Plan.from_json(blocks.to_json()).pipeline.checkpoint_positions == (5, 10, 15, 20, 25,
                                                                              30)
    one = dataclasses.replace(make_plan(), remat_positions=(3, 7))
    assert Plan.from_json(one.to_json()).remat_positions == (3, 7)
    assert not one.is_pipelined


@pytest.mark.parametrize("where, edit, message", [
    ("top", lambda d: d.update(compile_time_s=1.0),
     "plan field compile_time_s is not a field of this plan format"),
    ("top", lambda d: d.update(options={}), "plan field options is not a field"),
    ("stage", lambda d: d["stages"][0].update(colour="red"),
     "plan field stages[0].colour is not a field"),
    ("layout", lambda d: d["pipeline"].update(segments=[]),
     "plan field pipeline.segments is not a field"),
    ("record", lambda d: d["planning"].update(measured_idle_fraction=0.1),
     "plan field planning.measured_idle_fraction is not a field"),
    ("top", lambda d: d.pop("pipeline"), "plan is missing the field 'pipeline'"),
    ("layout", lambda d: d["pipeline"].pop("remat_stages"),
     "plan is missing the field 'pipeline.remat_stages'"),
    ("layout", lambda d: d["pipeline"].update(stage_of_piece=[0, 2]),
     "plan field pipeline.stage_of_piece names stage 2; the plan has stages 0 to 1"),
    ("layout", lambda d: d["pipeline"].update(stage_of_piece=[0, 0]),
     "plan field pipeline.stage_of_piece gives stage 0 2 piece"),
    ("layout", lambda d: d["pipeline"].update(piece_positions=[25]),
     "plan field pipeline.piece_positions cuts at 25, which is not one of layer_positions"),
    ("layout", lambda d: d["pipeline"].update(checkpoint_positions=[5, 10, 15, 30]),
     "plan field pipeline.piece_positions cuts at 20, which is not one of checkpoint_positions"),
    ("layout", lambda d: d["pipeline"].update(checkpoint_positions=[10, 5, 20]),
     "plan field pipeline.checkpoint_positions [10, 5, 20] must be positive and increasing"),
    ("layout", lambda d: d["pipeline"].update(remat_stages=[True]),
     "plan field pipeline.remat_stages has 1 flag"),
    ("top", lambda d: d.update(method="tensor"), "plan field method is invalid"),
    ("layout", lambda d: d["pipeline"].update(schedule="2f2b"),
     "plan field pipeline.schedule '2f2b' names no schedule; valid: gpipe, 1f1b"),
    ("top", lambda d: d.update(pipeline=None),
     "plan field pipeline is missing; a pipeshard plan needs its layout"),
])
def test_unknown_missing_and_inconsistent_fields_are_one_line_plan_errors(where, edit, message):
    data = pipelined_plan().to_dict()
    edit(data)
    with pytest.raises(PlanError) as err:
        Plan.from_dict(data)
    assert message in str(err.value) and "\n" not in str(err.value), (where, str(err.value))


def test_a_one_stage_plan_takes_no_pipeline_layout():
    data = make_plan().to_dict()
    data["pipeline"] = pipelined_plan().pipeline.to_dict()
    with pytest.raises(PlanError, match="a data plan runs one program; it takes no pipeline"):
        Plan.from_dict(data)


def version_1(plan: Plan) -> dict:
    """What autopar wrote as format version 1 for ``plan``: the layout, the remat cuts and
    the planning statistics in ``options``, beside run statistics."""
    d = plan.to_dict()
    options = {"compile_time_s": 3.5, "measured_idle_fraction": 0.4}
    if d["pipeline"] is not None:
        options["pipeline"] = d["pipeline"]
    if d["remat_positions"] is not None:
        options["remat_positions"] = d["remat_positions"]
    record = d["planning"]
    options |= {"planning_time_s": record["planning_time_s"], "timings": record["phases"],
                "stage_search": record["stage_search"],
                "estimated_idle_fraction": record["estimated_idle_fraction"],
                "theoretical_idle_fraction": record["theoretical_idle_fraction"]}
    options |= record["method_options"]
    for key in ("pipeline", "remat_positions", "planning"):
        del d[key]
    return d | {"format_version": 1, "options": options}


@pytest.mark.parametrize("make", [make_plan, pipelined_plan])
def test_version_1_files_load_as_the_same_plan_without_run_statistics(make):
    plan = make()
    if not plan.is_pipelined:
        plan = dataclasses.replace(plan, remat_positions=(3, 7))
    loaded = Plan.from_dict(version_1(plan))
    assert loaded == plan
    assert loaded.format_version == FORMAT_VERSION
    again = json.loads(loaded.to_json())
    assert "options" not in again and "compile_time_s" not in json.dumps(again)


def test_a_version_1_pipeline_without_remat_flags_reads_as_no_remat():
    data = version_1(pipelined_plan())
    del data["options"]["pipeline"]["remat_stages"]
    assert Plan.from_dict(data).pipeline.remat_stages == (False, False)


def test_each_plan_class_names_each_field_once_in_its_json_table():
    # one converter table per class is its JSON form both ways: a field added to the class
    # and not to its table would silently not be saved
    from autopar.plan.planning_record import RECORD_JSON, PlanningRecord
    from autopar.plan.stage import STAGE_JSON
    from autopar.plan.step import LAYOUT_JSON, PLAN_JSON, PipelineLayout

    for cls, table, outside in ((Plan, PLAN_JSON, {"format_version"}),
                                (StagePlan, STAGE_JSON, set()),
                                (PipelineLayout, LAYOUT_JSON, set()),
                                (PlanningRecord, RECORD_JSON, set())):
        names = [f.name for f in table]
        assert len(names) == len(set(names)), cls.__name__
        assert set(names) | outside == set(cls.__dataclass_fields__), cls.__name__


def test_a_plan_is_frozen_and_what_comes_later_makes_a_new_one():
    plan = make_plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.notes = ("changed",)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.planning.baseline = "changed"  # type: ignore[misc]
    later = plan.noted("later")
    first = plan.noted("first", first=True)
    assert later.notes == (*plan.notes, "later") and first.notes == ("first", *plan.notes)
    assert "later" not in plan.notes and "first" not in plan.notes
    recorded = plan.with_planning(baseline="megatron")
    assert recorded.planning.baseline == "megatron" and plan.planning.baseline is None
    assert Plan.from_json(later.to_json()) == later
