"""``autopar bench``: the smoke suite end to end (every output file exists and parses, nothing
timed), the Megatron specs on GPT's parameter paths, and one clear line for bad input."""

import json
import math

import jax
import pytest
from matplotlib.image import imread

import autopar
from autopar.bench import SUITE_NAMES, get_suite
from autopar.bench.baselines import (
    megatron_mesh,
    megatron_specs,
    plan_megatron,
    plan_single_device,
)
from autopar.bench.harness import output_prefix
from autopar.bench.machine import cpu_model
from autopar.bench.measure import MEASURE_ROUNDS
from autopar.cli.main import main
from autopar.cluster import load_cluster
from autopar.compiler.graph.trace import trace_step
from autopar.errors import InvalidOptionError
from autopar.models import get_model
from autopar.plan import MethodName, ShardingSpec
from autopar.runtime.local_cluster import local_cluster, sharing_one_host

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

SMOKE = get_suite("smoke")
PREFIX = output_prefix(SMOKE)
PLOTS = ("planning-vs-layers", "planning-vs-devices", "estimated-vs-measured", "baselines")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One run of the smoke suite, with a calibrated description of the local devices (the
    default one of its case's 2 devices, ``local_cluster``'s, at half its flops) so that path
    runs too."""
    out = tmp_path_factory.mktemp("bench")
    calibrated = sharing_one_host(load_cluster("cpu-sim").to_dict(), 2)
    calibrated["name"] = "cpu-sim-calibrated"
    calibrated["device"]["peak_flops"] = {
        k: v / 2 for k, v in calibrated["device"]["peak_flops"].items()}
    cal_path = out / "calibrated.json"
    cal_path.write_text(json.dumps(calibrated))
    code = main(["bench", "--suite", "smoke", "--out", str(out), "--calibrated", str(cal_path)])
    rows = [json.loads(line) for line in (out / f"{PREFIX}.jsonl").read_text().splitlines()]
    return code, out, rows


def test_smoke_suite_exits_zero_and_writes_every_file(smoke):
    code, out, rows = smoke
    assert code == 0
    written = {p.name for p in out.iterdir()} - {"calibrated.json"}
    assert written == {f"{PREFIX}.jsonl", f"{PREFIX}.md"} | {f"{PREFIX}-{p}.png" for p in PLOTS}
    assert len(rows) == len(SMOKE.cases) + len(SMOKE.scaling)
    assert all(r["suite"] == "smoke" for r in rows)


def _cases(rows):
    return [r for r in rows if r["kind"] == "case"]


def test_every_case_row_has_planning_phases_estimates_plan_and_baselines(smoke):
    _, _, rows = smoke
    cases = _cases(rows)
    assert [r["case"] for r in cases] == [c.name for c in SMOKE.cases]
    for row, case in zip(cases, SMOKE.cases, strict=True):
        assert "error" not in row
        planning = row["planning"]
        assert {"trace_s", "ilp_s", "dp_s", "other_s", "total_s"} <= set(planning)
        assert all(math.isfinite(v) and v >= 0 for v in planning.values())
        assert row["ilp_solves"] >= 1 and row["flops_per_step"] > 0
        assert row["est_step_time_s"] > 0 and row["est_tflops_per_device"] > 0
        plan = row["plan"]
        assert plan["method"] in {m.value for m in MethodName}
        assert plan["num_stages"] == len(plan["stages"]) >= 1
        # the full search's candidates: every method, one of them chosen, none faster
        candidates = row["candidates"]
        assert {"data", "shard", "zero2", "zero3", "pipeshard: stage DP"} <= \
            {c["name"] for c in candidates}
        assert sum(c["chosen"] for c in candidates) == 1
        # by estimate, none faster than the search's own choice (locally the clock keeps the
        # fastest measured of its best candidates, which may be estimated slower)
        own = row["search_est_step_time_s"]
        assert own <= row["est_step_time_s"]
        assert all(c["est_step_time_s"] >= own for c in candidates
                   if c["est_step_time_s"] is not None and c["fits"]
                   and c.get("eligible", True))
        for stage in plan["stages"]:
            assert {"layers", "submesh", "logical_mesh", "devices", "est_time_s"} <= set(stage)
        assert row["predicted_communication"]["time_s"] >= 0
        assert [b["name"] for b in row["baselines"]] == [b.value for b in case.baselines]
        for b in row["baselines"]:
            assert b["error"] is None, b
            assert b["est_step_time_s"] > 0 and b["est_ratio"] > 0
            assert b["plan"]["num_stages"] >= 1
            if b["name"] in ("data-parallel", "intra-op-only", "equal-layer",
                             "equal-operator"):  # the full search's own candidates
                assert b["est_step_time_s"] >= own * (1 - 1e-9)


def test_local_rows_have_measured_times_hlo_counts_and_cost_model_ratios(smoke):
    _, _, rows = smoke
    local = [r for r in _cases(rows) if r["where"] == "local"]
    assert local
    for row in local:
        measured = row["measured"]
        # timed in interleaved rounds beside the one-stage baselines
        assert measured["step_time_s"] > 0
        assert len(measured["step_times_s"]) == 3 * MEASURE_ROUNDS
        simple = row["simple_vs_default"]
        assert simple["best_simple"] in ("data-parallel", "intra-op-only")
        assert simple["ratio"] == pytest.approx(simple["best_simple_s"] / simple["default_s"])
        assert measured["tflops_per_device"] > 0
        model = row["cost_model"]
        assert model["measured_over_default"] > 0 and model["measured_over_calibrated"] > 0
        # the calibrated ratio is about the program the calibrated plan runs: the default's
        # measurement when the plans agree, that plan's own run when they do not
        assert model["measured_over_calibrated"] == pytest.approx(
            model["measured_calibrated_s"] / model["est_calibrated_s"])
        if model["same_plan"]:
            assert model["measured_calibrated_s"] == model["measured_s"]
        # half the flops: every plan slower, so the calibrated search's best is slower than
        # the default search's own (not than the plan the clock kept, which may be estimated
        # slower than the search's choice: a loaded run kept one)
        assert model["est_calibrated_s"] > row["search_est_step_time_s"]
        timed = {b["name"]: b for b in row["baselines"] if b["measured_step_time_s"]}
        assert {"single-device", "data-parallel"} <= set(timed)
        # one device alone, described as it runs: not as one of the case's devices, which
        # share the host (runtime.local_cluster.sharing_one_host)
        case = next(c for c in SMOKE.cases if c.cluster is None)
        model = get_model(case.model, case.size, **dict(case.overrides)).with_value_and_grad(
            autopar.value_and_grad)
        alone = plan_single_device(trace_step(model.train_step, model.abstract_inputs()),
                                   local_cluster(jax.devices()[:1]))
        assert timed["single-device"]["est_step_time_s"] == pytest.approx(
            alone.est_step_time_s, rel=1e-6)
        for b in timed.values():
            assert b["measured_ratio"] > 0 and b["cost_model"]["measured_over_default"] > 0
        # two devices: the gradient is all-reduced, in the plan and in the compiled program
        dp = timed["data-parallel"]
        assert dp["hlo_collectives"]["all-reduce"]["count"] >= 1
        assert dp["predicted_communication"]["collectives"]["all-reduce"]["count"] >= 1
        assert row["baselines"][-1]["name"] == "equal-layer"
        assert row["baselines"][-1]["measured_step_time_s"] is None  # estimated only
        # the one-stage pipeline, timed beside its stage run by ShardParallel; its tasks'
        # measured time gives the runtime's overhead (one program: about the step)
        one = timed["one-stage pipeline"]
        assert one["plan"]["method"] == "pipeshard" and one["plan"]["num_stages"] == 1
        assert one["over_same_stage_shard"] == pytest.approx(
            one["measured_step_time_s"] / one["same_stage_shard_s"])
        # and beside the pipeline at one microbatch: the two ratios split its cost over
        # ShardParallel into the microbatches' (over it) and the runtime's (it over ShardParallel)
        assert one["one_microbatch_s"] > 0
        assert one["over_one_microbatch"] * one["one_microbatch_over_same_stage_shard"] == (
            pytest.approx(one["over_same_stage_shard"]))
        assert "at one microbatch" in one["note"]
        # and beside the same microbatches accumulated by a hand-written step under jax.jit,
        # whose compiled program reduces the gradient over the two devices
        assert one["over_hand_accumulation"] == pytest.approx(
            one["measured_step_time_s"] / one["hand_accumulation_s"])
        assert one["hand_accumulation_collectives"]["all-reduce"]["count"] >= 1
        assert "accumulated by hand" in one["note"]
        assert one["measured"]["runtime_overhead"] == pytest.approx(
            one["measured_step_time_s"] / one["measured"]["task_compute_s"])
        # autopar's plan has the column when it is pipelined
        assert (measured["runtime_overhead"] is None) == (row["plan"]["method"] != "pipeshard")


def test_hand_plans_are_planned_everywhere_and_run_with_jit_locally(smoke):
    """Every case carries the hand plans that apply to it; none is estimated faster than
    autopar's plan (the free ILP is one of the full search's candidates); locally each runs as
    ``jax.jit(step, in_shardings=hand)`` with XLA's collectives counted."""
    _, out, rows = smoke
    for row in _cases(rows):
        names = [h["name"] for h in row["hand_plans"]]
        assert "data" in names and "zero3" in names
        for h in row["hand_plans"]:
            assert h["error"] is None and h["est_step_time_s"] > 0
            assert h["est_step_time_s"] >= row["search_est_step_time_s"] * (1 - 1e-9), \
                (row["case"], h)
        if row["where"] == "local":
            data = next(h for h in row["hand_plans"] if h["name"] == "data")
            assert data["measured_step_time_s"] > 0 and data["measured_ratio"] > 0
            assert data["hlo_collectives"]["all-reduce"]["count"] >= 1  # the gradient
        else:
            assert "data-megatron" in names  # 8 devices: a 2x4 mesh
            assert all(h["measured_step_time_s"] is None for h in row["hand_plans"])
    text = (out / f"{PREFIX}.md").read_text()
    assert "| data | 1x2 |" in text and "| data-megatron | 2x4 |" in text


def test_what_if_row_sits_beside_the_published_figure(smoke):
    _, _, rows = smoke
    (row,) = [r for r in _cases(rows) if r["what_if"]]
    assert row["where"] == "described" and row["cluster"] == "aws-p3.16xlarge"
    what_if = row["what_if"]
    assert what_if["published_tflops_per_device"] == 37.01
    # Alpa counts the recomputed forward; without it, 72/96 of the layers' flops remain
    assert 0.75 * 37.01 < what_if["published_tflops_per_device_without_recompute"] < 37.01
    assert what_if["est_tflops_per_device_alpa_formula"] > 0 and what_if["est_over_published"] > 0
    assert what_if["comparable"] is False  # the smoke case is a 1-layer copy
    megatron = next(b for b in row["baselines"] if b["name"] == "megatron")
    assert megatron["plan"]["stages"][0]["logical_mesh"] == "8"


def test_scaling_rows_cover_both_axes(smoke):
    _, _, rows = smoke
    points = [r for r in rows if r["kind"] == "scaling"]
    assert {r["axis"] for r in points} == {"layers", "devices"}
    assert all(r["est_step_time_s"] > 0 and r["bound_by"] for r in points)
    for r in points:
        assert r["planning"]["total_s"] > 0 and r["ilp_solves"] >= 1 and r["x"] >= 1


def test_markdown_has_a_row_per_case_and_describes_the_machine(smoke):
    _, out, rows = smoke
    text = (out / f"{PREFIX}.md").read_text()
    for row in _cases(rows):
        assert f"| {row['case']} |" in text
    assert cpu_model() in text and "cores" in text and f"jax {jax.__version__}" in text
    assert "autopar bench --suite smoke" in text and "UTC" in text
    for plot in PLOTS:
        assert f"]({PREFIX}-{plot}.png)" in text


@pytest.mark.parametrize("plot", PLOTS)
def test_plots_decode(smoke, plot):
    _, out, _ = smoke
    image = imread(out / f"{PREFIX}-{plot}.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def P(*dims):
    """A spec in PartitionSpec notation: ``P(None, "y")``."""
    return ShardingSpec(tuple(() if d is None else (d,) for d in dims))


@pytest.fixture(scope="module")
def gpt_tiny():
    model = get_model("gpt", "tiny")
    return trace_step(model.train_step, model.abstract_inputs())


def test_megatron_specs_on_gpt_tiny_paths(gpt_tiny):
    graph = gpt_tiny.graph
    leaves = [(io.path, graph.tensors[io.tensor].ndim) for io in graph.inputs]
    specs = megatron_specs(leaves, "y")
    column, row = P(None, "y"), P("y", None)
    for prefix in ("state/params", "state/opt_state/0/mu", "state/opt_state/0/nu"):
        block = f"{prefix}/blocks/1"
        for name in ("attn/q", "attn/k", "attn/v", "mlp/fc_in"):
            assert specs[f"{block}/{name}/kernel"] == column
        for name in ("attn/q", "attn/v", "mlp/fc_in"):
            assert specs[f"{block}/{name}/bias"] == P("y")
        for name in ("attn/out", "mlp/fc_out"):
            assert specs[f"{block}/{name}/kernel"] == row
            assert specs[f"{block}/{name}/bias"] == P(None)
        assert specs[f"{block}/ln1/scale"] == P(None)
        assert specs[f"{prefix}/wte"] == P(None, None)
    assert specs["state/opt_state/0/count"] == ShardingSpec(())
    state = {path for path, _ in leaves if path.startswith("state/")}
    assert set(specs) == state  # every state leaf, no batch leaf


def test_megatron_mesh_is_tensor_parallel_inside_a_host():
    assert megatron_mesh(load_cluster("aws-p3.16xlarge")).shape == (8,)
    assert megatron_mesh(load_cluster("aws-p3.16xlarge-8nodes")).shape == (8, 8)


def test_megatron_plan_keeps_the_pinned_specs(gpt_tiny):
    plan = plan_megatron(gpt_tiny, load_cluster("aws-p3.16xlarge-8nodes"))
    specs = plan.stages[0].input_shardings
    assert specs["state/params/blocks/0/attn/q/kernel"] == P(None, "y")
    assert specs["state/params/blocks/0/mlp/fc_out/kernel"] == P("y", None)
    assert plan.planning.baseline == "megatron" and plan.est_step_time_s > 0


def test_unknown_suite_is_one_line_and_exit_2(capsys):
    assert main(["bench", "--suite", "nope", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autopar: error:") and "smoke" in err
    with pytest.raises(InvalidOptionError, match="valid suites: " + ", ".join(SUITE_NAMES)):
        get_suite("nope")


def test_missing_calibrated_file_is_one_line_and_exit_2(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    assert main(["bench", "--suite", "smoke", "--out", str(tmp_path),
                 "--calibrated", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.json" in err
    assert not list(tmp_path.glob("bench-*"))  # nothing ran


def test_a_calibrated_plan_that_is_not_the_default_plan_is_timed_itself(monkeypatch):
    """The calibrated ratio sets the calibrated plan's estimate beside that plan's own clock:
    a plan the calibrated description chose differently is run, not read off the default
    plan's measurement."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from autopar.bench import runner

    cluster = load_cluster("cpu-sim").with_devices(1, 2)
    default, calibrated = SimpleNamespace(est_step_time_s=1.0), SimpleNamespace(
        est_step_time_s=2.0)
    ran = []

    class Local:
        def run(self, plan):
            ran.append(plan)
            return SimpleNamespace(median_s=3.0)

    options = runner.RunOptions(devices=2, calibrated=cluster)
    for same in (False, True):
        ran.clear()
        monkeypatch.setattr(runner, "same_plan", lambda a, b, same=same: same)
        model = runner._cost_model(1.0, 1.5, options, cluster, lambda _: nullcontext(),
                                   lambda _: calibrated, default, Local())
        assert model["measured_over_default"] == pytest.approx(1.5)
        assert ran == ([] if same else [calibrated])
        assert model["measured_calibrated_s"] == (1.5 if same else 3.0)
        assert model["measured_over_calibrated"] == pytest.approx(0.75 if same else 1.5)
