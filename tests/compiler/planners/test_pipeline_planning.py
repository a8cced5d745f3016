"""PipeshardParallel planning: the stage DP against the usual hand splits, the default method,
the pipeline report, and one clear error for each impossible request."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tanh_mlp import tanh_mlp_step

import autopar
from autopar.cli.main import main
from autopar.cluster import load_cluster
from autopar.compiler.planners.pipeline_splits import stage_baselines
from autopar.errors import BatchSizeError, NoLossFunctionError, PlanError
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model
from autopar.plan import Plan
from autopar.runtime.measured_choice import CLOCK_MARGIN

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e


def uneven_mlp(widths=(32, 32, 512, 32, 32), batch=32, vg=autopar.value_and_grad):
    """Dense layers of unequal widths: one layer holds most of the flops."""
    opt = optax.sgd(0.05)
    keys = jax.random.split(jax.random.key(0), len(widths) + 1)
    params = [jax.random.normal(k, (a, b)) * a**-0.5
              for k, a, b in zip(keys, widths[:-1], widths[1:], strict=False)]
    batch_data = {"x": jax.random.normal(keys[-1], (batch, widths[0])),
                  "y": jnp.zeros((batch, widths[-1]))}

    step = tanh_mlp_step(opt, vg)

    return step, {"params": params, "opt": opt.init(params)}, batch_data


def test_dp_beats_equal_layer_and_equal_operator_stages(capsys):
    step, state, batch = uneven_mlp()
    cluster = load_cluster("cpu-sim").with_devices(1, 4)
    pp = build_pipeline_program(step, (state, batch), (1,), 4)
    method = autopar.PipeshardParallel(num_microbatches=4, layers=4, num_stages=2)
    found = stage_baselines(pp, method, cluster)
    dp = found["dp"].total_time
    ratios = {name: part.total_time / dp for name, part in found.items()}
    with capsys.disabled():
        print(f"\nestimated step time / DP's: {ratios}")
    assert set(found) == {"dp", "equal-layer", "equal-operator"}
    assert dp < found["equal-layer"].total_time
    assert dp < found["equal-operator"].total_time
    # the DP balances by moving the cut away from the middle of the layers
    ranges = [(st.start, st.end) for st in found["dp"].stages]
    assert ranges != [(st.start, st.end) for st in found["equal-layer"].stages]


def test_default_method_is_the_full_search_and_falls_back_without_a_marked_loss():
    step, state, batch = uneven_mlp(widths=(16, 16, 16), batch=16)
    auto = autopar.parallelize(step)
    plan = auto.get_plan(state, batch)
    # the full search compared every method, pipelines included (here skipped by their bound,
    # with a row saying so), and kept the fastest
    assert plan.planning.method_options["method"] == "auto"
    names = {c["name"] for c in plan.planning.candidates}
    assert {"data", "shard", "zero2", "zero3"} <= names
    assert any(n == "pipeshard" or n.startswith("pipeshard: ") for n in names)
    chosen = [c for c in plan.planning.candidates if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["method"] == plan.method
    # on the devices it runs on, the search timed its choice beside the simple plans and kept
    # the fastest measured, or its own choice where none was faster by more than the clock's
    # margin (``AutoParallel.measure_candidates``, ``measured_choice.CLOCK_MARGIN``; a
    # one-stage pipeline is set aside when a one-stage plan fits, ``eligible`` false: its
    # split's costs are not in its estimate)
    measured = {c["name"]: c["measured_step_time_s"] for c in plan.planning.candidates
                if "measured_step_time_s" in c}
    assert {"data", "shard"} & set(measured) and len(measured) >= 2
    assert chosen[0]["name"] in measured
    assert measured[chosen[0]["name"]] * (1 - CLOCK_MARGIN) <= min(measured.values())
    ref_state, ref_loss = jax.jit(step)(state, batch)
    new_state, loss = auto(state, batch)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ref_state), jax.tree_util.tree_leaves(new_state),
                    strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)

    # without a marked loss (the search's choice kept as estimated: timing was checked above)
    plain, *_ = uneven_mlp(widths=(16, 16, 16), batch=16, vg=jax.value_and_grad)
    fallback = autopar.parallelize(
        plain, method=autopar.AutoParallel(measure_candidates=0)).get_plan(state, batch)
    assert fallback.method in ("data", "shard", "zero2", "zero3")
    assert any("no pipelined candidate" in n for n in fallback.notes)
    assert not any(c["method"] == "pipeshard" for c in fallback.planning.candidates)
    with pytest.raises(NoLossFunctionError, match="exactly one autopar.value_and_grad"):
        autopar.parallelize(plain, method=autopar.PipeshardParallel()).get_plan(state, batch)


def test_pipeshard_plan_round_trips_through_json():
    step, state, batch = uneven_mlp(widths=(16, 16, 16), batch=16)
    par = autopar.parallelize(step, method=autopar.PipeshardParallel(
        num_microbatches=2, stages="uniform", num_stages=2, layers=2))
    plan = par.get_plan(state, batch)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.pipeline.stage_of_piece == (0, 1)
    assert any(st.tensor_shardings for st in again.stages)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"stages": "uniform", "num_stages": 4, "layers": 2}, PlanError,
         r"2 layers cannot be cut into 4 stages"),
        ({"num_stages": 16, "layers": 2}, PlanError, r"16"),
        ({"num_microbatches": 3}, BatchSizeError,
         r"num_microbatches=3 must divide the batch size 16"),
        ({"stages": autopar.ManualStages(((0, 1), (2, 3)), ((1, 4), (1, 4))), "layers": 3},
         PlanError, r"cover"),
        ({"memory_budget_bytes": 64.0, "layers": 2}, PlanError, r"memory|fit"),
    ],
    ids=["stages>layers", "stages>devices", "microbatches", "manual-gap", "memory"],
)
def test_impossible_requests_get_one_clear_line(options, error, message):
    step, state, batch = uneven_mlp(widths=(16, 16, 16), batch=16)
    method = autopar.PipeshardParallel(**{"num_microbatches": 2, **options})
    with pytest.raises(error, match=message) as err:
        autopar.parallelize(step, method=method).get_plan(state, batch)
    assert "\n" not in str(err.value)


def test_cli_reports_the_pipeline_and_draws_the_swimlane(tmp_path, capsys):
    png, report = tmp_path / "swim.png", tmp_path / "r.json"
    argv = ["compile", "--model", "mlp", "--devices", "8", "--stages", "uniform",
            "--num-stages", "2", "--pipeline-layers", "2", "--swimlane", str(png),
            "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "method            pipeshard" in out
    assert "pipeline: 1f1b, 4 microbatches, 2 stages" in out
    assert "stage 0 |" in out and "stage 1 |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(report.read_text())
    pipe = data["pipeline"]
    # 1F1B with equal stage times idles (p-1)/(m+p-1) of the time
    assert pipe["theoretical_idle_fraction"] == pytest.approx(1 / 5)
    assert 0 < pipe["estimated_idle_fraction"] < 1


def test_cli_bad_schedule_is_one_line(capsys):
    assert main(["compile", "--model", "mlp", "--schedule", "2f2b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown schedule '2f2b'; valid schedules:" in err[0]


def test_zoo_model_plans_as_a_pipeline():
    model = get_model("gpt", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 4)
    assert len(pp.split_inputs) == len(model.abstract_batch())
    assert pp.batch_size == model.config.batch_size


def test_timed_call_records_every_task_and_measures_the_idle_fraction():
    step, state, batch = uneven_mlp(widths=(16, 16, 16), batch=16)
    par = autopar.parallelize(step, method=autopar.PipeshardParallel(
        num_microbatches=4, stages="uniform", num_stages=2, layers=2, schedule="gpipe"))
    (_, loss), records = par.timed_call(state, batch)
    assert float(loss) == pytest.approx(float(jax.jit(step)(state, batch)[1]), rel=1e-5)
    # 2 stages x 4 microbatches x (F, B), each with its start before its end
    assert sorted((r.stage, r.kind, r.microbatch) for r in records) == sorted(
        (s, k, i) for s in range(2) for k in "FB" for i in range(4))
    assert all(math.isfinite(r.start_s) and r.end_s >= r.start_s >= 0 for r in records)
    # records come in the order the driver ran the tasks: GPipe's forward of a microbatch runs
    # on stage 0 before stage 1
    order = {(r.stage, r.kind, r.microbatch): k for k, r in enumerate(records)}
    assert all(order[(0, "F", i)] < order[(1, "F", i)] for i in range(4))
    measured = par.run_statistics(state, batch).measured_idle_fraction
    assert 0.0 <= measured < 1.0
