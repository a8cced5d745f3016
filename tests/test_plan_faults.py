"""A saved plan edited by hand into something inconsistent is refused with one ``PlanError`` line
naming the field, never an error from deep inside JAX: through ``parallelize(plan=FILE)`` and,
for what a plan file shows on its own, through ``autopar show``. The plans are real ones (of the
tanh-MLP step), saved, edited as JSON and loaded again."""

from __future__ import annotations

import copy
import json

import jax
import numpy as np
import optax
import pytest
from tanh_mlp import tanh_mlp_step

import autopar
from autopar.cli.main import main
from autopar.errors import PlanError

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

OPT = optax.sgd(0.1)
STEP = tanh_mlp_step(OPT)
SHARD = autopar.ShardParallel(mesh_shape=(2, 4))
PIPESHARD = autopar.PipeshardParallel(num_microbatches=2, stages="uniform", num_stages=2)


def inputs() -> tuple[dict, dict]:
    k = jax.random.split(jax.random.key(0), 4)
    params = [jax.random.normal(k[0], (8, 16)) * 0.3, jax.random.normal(k[1], (16, 4)) * 0.3]
    batch = {"x": jax.random.normal(k[2], (16, 8)), "y": jax.random.normal(k[3], (16, 4))}
    return {"params": params, "opt": OPT.init(params)}, batch


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    state, batch = inputs()
    made = {name: autopar.parallelize(STEP, method=method, cache=False).get_plan(state, batch)
            for name, method in (("shard", SHARD), ("pipeshard", PIPESHARD))}
    # the edits below assume these layouts: fail here, not with a puzzling message later
    assert made["shard"].stages[0].axis_names == ("x", "y")
    assert made["shard"].stages[0].device_ids == tuple(range(8))
    assert [s.device_ids for s in made["pipeshard"].stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert made["pipeshard"].stages[1].tensor_shardings
    return {name: plan.to_dict() for name, plan in made.items()}


def _stage(d, i=0):
    return d["stages"][i]


def _set(mapping, key, value):
    mapping[key] = value


def _first_tensor(d, i):
    return next(iter(_stage(d, i)["tensor_shardings"]))


# (plan, edit of its JSON, what the one line must say): each is found in the file alone, so
# ``parallelize(plan=...)`` refuses it when it loads the file and ``autopar show`` too
FILE_FAULTS = {
    "spec-names-an-unknown-axis": (
        "shard", lambda d: _set(_stage(d)["input_shardings"], "state/params/0", [["z"], []]),
        "plan field stages[0].input_shardings['state/params/0'] names mesh axis 'z'; the "
        "stage's axes are x, y"),
    "intermediate-spec-names-an-axis-of-another-stage": (
        "pipeshard",
        lambda d: _set(_stage(d, 1)["tensor_shardings"], _first_tensor(d, 1), [["y"], []]),
        "names mesh axis 'y'; the stage's axes are x"),
    "output-spec-names-an-unknown-axis": (
        "shard", lambda d: _set(_stage(d)["output_shardings"], "out/0/params/1", [[], ["w"]]),
        "plan field stages[0].output_shardings['out/0/params/1'] names mesh axis 'w'"),
    "stage-without-devices": (
        "shard", lambda d: _set(_stage(d), "device_ids", []),
        "plan field stages[0].device_ids is empty"),
    "second-stage-without-devices": (
        "pipeshard", lambda d: _set(_stage(d, 1), "device_ids", []),
        "plan field stages[1].device_ids is empty"),
    "negative-device-id": (
        "shard", lambda d: _set(_stage(d), "device_ids", [0, 1, 2, 3, 4, 5, 6, -1]),
        "plan field stages[0].device_ids holds -1"),
    "duplicated-device-id": (
        "shard", lambda d: _set(_stage(d), "device_ids", [0, 1, 2, 3, 4, 5, 6, 6]),
        "plan field stages[0].device_ids names device 6 more than once"),
    "device-count-is-not-the-mesh-size": (
        "shard", lambda d: _set(_stage(d), "device_ids", [0, 1, 2, 3, 4, 5]),
        "plan field stages[0].device_ids has 6 device(s) but the logical_mesh_shape [2, 4] "
        "has 8 places"),
    "mesh-shape-without-its-axis-names": (
        "shard", lambda d: _set(_stage(d), "logical_mesh_shape", [2, 2, 2]),
        "plan field stages[0].axis_names has 2 name(s) for the 3-D logical_mesh_shape"),
    "device-ids-not-a-list": (
        "shard", lambda d: _set(_stage(d), "device_ids", 8),
        "plan field stages[0].device_ids is invalid"),
    "spec-with-too-many-dimensions": (
        "shard", lambda d: _set(_stage(d)["input_shardings"], "batch/x", [["x"], [], []]),
        "plan field stages[0].input_shardings['batch/x'] has 3 dimension(s) but the signature "
        "gives 'batch/x' the shape [16, 8]"),
    "split-that-does-not-divide": (
        "shard", lambda d: _set(_stage(d)["input_shardings"], "state/params/1", [[], ["x", "y"]]),
        "plan field stages[0].input_shardings['state/params/1'] splits dimension 1 (size 4) "
        "into 8 pieces"),
    "no-microbatches": (
        "pipeshard", lambda d: _set(d, "num_microbatches", 0),
        "plan field num_microbatches=0 must be a positive integer"),
    "missing-stage-field": (
        "shard", lambda d: _stage(d).pop("axis_names"),
        "plan is missing the field 'stages[0].axis_names'"),
}

# found only where the plan meets the step: its batch and the devices it runs on
RUN_FAULTS = {
    "device-id-beyond-the-devices": (
        "shard", lambda d: _set(_stage(d), "device_ids", [0, 1, 2, 3, 4, 5, 6, 8]),
        "plan field stages[0].device_ids names device 8; this step runs on 8 device(s)"),
    "pipeline-stage-beyond-the-devices": (
        "pipeshard", lambda d: _set(_stage(d, 1), "device_ids", [4, 5, 6, 9]),
        "plan field stages[1].device_ids names device 9; this step runs on 8 device(s)"),
    "microbatches-that-do-not-divide-the-batch": (
        "pipeshard", lambda d: _set(d, "num_microbatches", 3),
        "plan field num_microbatches=3 does not divide this step's batch size 16"),
    "more-microbatches-than-examples": (
        "pipeshard", lambda d: _set(d, "num_microbatches", 32),
        "plan field num_microbatches=32 does not divide this step's batch size 16"),
    "output-spec-of-the-wrong-rank": (
        "shard", lambda d: _set(_stage(d)["output_shardings"], "out/1", [["x"]]),
        "plan field stages[0].output_shardings['out/1'] has 1 dimension(s) but the value it "
        "shards has the shape []"),
}


def _edited(plans, tmp_path, base, edit):
    d = copy.deepcopy(plans[base])
    edit(d)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d, indent=1))
    return path


def _refused_in_one_line(path, message, **kwargs):
    state, batch = inputs()
    with pytest.raises(PlanError) as err:
        autopar.parallelize(STEP, plan=path, cache=False, **kwargs)(state, batch)
    text = str(err.value)
    assert "\n" not in text
    assert message in text, text


def _show(path, capsys):
    code = main(["show", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("base", ["shard", "pipeshard"])
def test_the_unedited_plans_run_and_show(plans, base, tmp_path, capsys):
    """The control: the plans before editing load, run and show."""
    path = _edited(plans, tmp_path, base, lambda d: None)
    state, batch = inputs()
    _, loss = autopar.parallelize(STEP, plan=path, cache=False)(state, batch)
    assert np.isfinite(float(loss))
    code, out, err = _show(path, capsys)
    assert code == 0, err


@pytest.mark.parametrize("fault", sorted(FILE_FAULTS))
def test_an_inconsistent_plan_file_is_one_line_naming_the_field(plans, fault, tmp_path, capsys):
    base, edit, message = FILE_FAULTS[fault]
    path = _edited(plans, tmp_path, base, edit)
    _refused_in_one_line(path, message)
    code, out, err = _show(path, capsys)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), err
    assert message in lines[0] and str(path) in lines[0], lines[0]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("fault", sorted(RUN_FAULTS))
def test_a_plan_that_does_not_fit_the_run_is_one_line_naming_the_field(plans, fault, tmp_path):
    base, edit, message = RUN_FAULTS[fault]
    _refused_in_one_line(_edited(plans, tmp_path, base, edit), message)


def test_a_plan_for_more_devices_than_the_step_has_is_one_line(plans, tmp_path):
    """Unedited: a plan saved on 8 devices, run on 4 of them."""
    path = _edited(plans, tmp_path, "shard", lambda d: None)
    _refused_in_one_line(path, "plan field stages[0].device_ids names device 4; this step runs "
                               "on 4 device(s), ids 0 to 3", devices=jax.devices()[:4])


def test_a_plan_object_built_in_code_is_checked_too(plans):
    """``parallelize(plan=Plan)`` skips the file, not the checks."""
    plan = autopar.Plan.from_dict(plans["shard"])
    plan.stages[0].device_ids = (0, 1, 2, 3, 4, 5, 7, 7)
    state, batch = inputs()
    with pytest.raises(PlanError, match="names device 7 more than once"):
        autopar.parallelize(STEP, plan=plan, cache=False)(state, batch)
