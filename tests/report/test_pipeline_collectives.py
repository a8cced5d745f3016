"""A pipelined plan's collectives: every program of one step counted in its compiled HLO, times
its calls, and set beside the stage plans' prediction in the compile report (text, ``--json``,
HTML, and ``autopar show`` of the document); and a scanned model's loop bodies counted per layer."""

from __future__ import annotations

import json
import re

import jax
import pytest

import autopar
from autopar.cli.main import main
from autopar.models import get_model
from autopar.plan import Plan

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

MICROBATCHES = 2


def run(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def reduced_bytes(kinds: dict) -> float:
    """All-reduce and reduce-scatter bytes: XLA's CPU backend emits a reduce-scatter as an
    all-reduce and a slice, so a plan's reduce-scatters are all-reduces in the HLO."""
    return sum(kinds.get(k, {"bytes": 0})["bytes"] for k in ("all-reduce", "reduce-scatter"))


def test_report_sets_each_stage_emitted_collectives_beside_its_plan(tmp_path, capsys):
    doc_path, page_path = tmp_path / "report.json", tmp_path / "report.html"
    code, out, err = run(["compile", "--model", "gpt", "--size", "tiny", "--method", "pipeshard",
                          "--microbatches", MICROBATCHES, "--stages", "uniform",
                          "--num-stages", 2, "--pipeline-layers", 2,
                          "--json", doc_path, "--html", page_path], capsys)
    assert code == 0, err
    doc = json.loads(doc_path.read_text())
    plan = Plan.from_dict(doc["plan"])
    assert len(plan.stages) == 2
    for stage in plan.stages:  # tensor-parallel stages: weights split over the stage's mesh
        assert any(spec.dims and any(spec.dims) for path, spec in stage.input_shardings.items()
                   if path.endswith("kernel")), stage.input_shardings
    collectives = doc["collectives"]
    predicted, hlo = collectives["predicted"], collectives["hlo"]
    assert hlo["all-reduce"]["count"] > 0
    assert reduced_bytes(hlo) == pytest.approx(reduced_bytes(predicted), rel=0.1)
    stages = collectives["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    # the last stage makes the tied embedding's gradient from a split microbatch and reduces
    # its partial sums once per step, as its plan prices it (``runtime.gradient_sinks``):
    # reduced in each microbatch's backward, the stage emitted 22% more than predicted
    assert any(key.endswith(":sum") for key in plan.stages[1].contraction_shardings)
    for s in stages:  # every stage all-reduces (Megatron's activations), as its plan says
        assert s["hlo"]["all-reduce"]["count"] > 0
        assert reduced_bytes(s["hlo"]) == pytest.approx(reduced_bytes(s["predicted"]),
                                                        rel=1e-6), s
    for kind, total in hlo.items():  # the step's programs are the stages' programs
        assert sum(s["hlo"][kind]["bytes"] for s in stages) == total["bytes"]

    # the text report: the totals and each stage, plan beside HLO
    rows = [line for line in out.splitlines() if re.match(r"\s+(stage \d: )?all-reduce", line)]
    assert len(rows) == 3 and all("| hlo" in r and "bytes ratio" in r for r in rows), out
    assert "HLO counted over one step" in out
    # the page: a row per stage and kind
    page = page_path.read_text()
    section = page.split('<section id="collectives">')[1].split("</section>")[0]
    assert section.count('class="stage-collective"') == sum(
        1 for s in stages for k in set(s["predicted"]) | {k for k, v in s["hlo"].items()
                                                          if v["count"]})
    # autopar show reads the counts back from the document
    code, shown, err = run(["show", doc_path], capsys)
    assert code == 0, err
    assert [line for line in shown.splitlines() if "all-reduce" in line] == rows


def _stage_collectives(tmp_path, capsys, *extra):
    doc_path = tmp_path / "report.json"
    code, _, err = run(["compile", "--model", "gpt", "--size", "tiny", "--method", "pipeshard",
                        "--microbatches", MICROBATCHES, *extra, "--json", doc_path], capsys)
    assert code == 0, err
    doc = json.loads(doc_path.read_text())
    return Plan.from_dict(doc["plan"]), doc["collectives"]["stages"]


def test_a_stage_runs_its_backward_contractions_as_its_plan_does(tmp_path, capsys):
    """Four stages of two devices: the last stage's plan runs the head's and the tied
    embedding's gradient contractions split, from operands that come whole, and reduces their
    partial sums. The runtime derives the backward with jax.vjp, where nothing held those
    operands: XLA ran the contractions whole on both devices and reduced 32 KiB of the
    196 KiB the stage predicted. It now holds what each transpose reads
    (``contraction_shardings``)."""
    plan, stages = _stage_collectives(tmp_path, capsys, "--stages", "uniform",
                                      "--num-stages", 4, "--pipeline-layers", 4)
    assert len(stages) == 4 and any(st.contraction_shardings for st in plan.stages)
    for s in stages:
        assert reduced_bytes(s["hlo"]) == pytest.approx(reduced_bytes(s["predicted"]),
                                                        rel=1e-6), s


def test_a_stage_lays_its_cotangents_out_as_its_plan_does(tmp_path, capsys):
    """One stage of 4 x 2: the plan lays a cotangent out otherwise than its forward value
    and gathers it for the tied embedding's gradient. Held to the value's layout (what a
    sharding constraint's transpose does), XLA gathered nothing; held to the plan's
    (``cotangent_shardings``), the compiled step gathers what the plan predicts."""
    plan, (stage,) = _stage_collectives(tmp_path, capsys)
    assert plan.stages[0].cotangent_shardings
    predicted = stage["predicted"]["all-gather"]["bytes"]
    assert predicted > 0 and stage["hlo"]["all-gather"]["bytes"] == predicted


def test_each_task_program_counts_once_per_microbatch():
    model = get_model("mlp", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    method = autopar.PipeshardParallel(num_microbatches=MICROBATCHES, stages="uniform",
                                       num_stages=2, layers=2)
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    counted = step.pipeline_collectives(state, batch)
    calls: dict[str, int] = {}
    for program in counted.programs:
        calls[program.label] = calls.get(program.label, 0) + program.calls
    # the forward and backward of each of the two pieces run once per microbatch
    for piece in range(2):
        assert calls[f"F{piece}"] == calls[f"B{piece}"] == MICROBATCHES
    assert all(n == 1 for label, n in calls.items() if label.startswith("segment"))
    assert step.get_hlo_collectives(state, batch) == counted.by_kind()


def test_a_pipelined_step_keeps_gradients_and_state_in_its_plans_layouts():
    """The stage plan splits GPT's weights (Megatron) and prices no gathering of them: the
    step's gradients and optimizer update stay on those shards, and the new state comes back
    in the plan's layouts. Placing them replicated on the way to the update (as the driver
    once did) gathered every sharded gradient: 18 all-gathers the plan did not predict."""
    from autopar.runtime.shard import partition_spec

    model = get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    method = autopar.PipeshardParallel(num_microbatches=MICROBATCHES, num_stages=1,
                                       stages="uniform", layers=2)
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    plan = step.get_plan(state, batch)
    specs = plan.stages[0].input_shardings
    assert any(spec.dims and any(spec.dims) for path, spec in specs.items()
               if path.endswith("kernel")), specs
    state, _ = step(state, batch)
    compared = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = "state/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if name in specs:
            want = jax.sharding.NamedSharding(leaf.sharding.mesh, partition_spec(specs[name]))
            assert want.is_equivalent_to(leaf.sharding, leaf.ndim), (name, leaf.sharding)
            compared += 1
    assert compared == sum(1 for p in specs if p.startswith("state/params/"))
    predicted: dict[str, float] = {}
    for c in plan.stages[0].collectives:  # nbytes: all of its count together (report.text)
        predicted[c.kind.value] = predicted.get(c.kind.value, 0.0) + c.nbytes
    emitted = step.get_hlo_collectives(state, batch)
    assert emitted["all-gather"]["bytes"] <= 1.1 * predicted.get("all-gather", 0.0)


def test_a_pipelined_steps_batch_statistics_are_averaged_where_they_were_made():
    """Wide-ResNet's loss returns its batch statistics (aux), one per microbatch, split by
    channel as the stage made them: their mean over microbatches is taken in that layout, and
    only the mean is then gathered, once per step, as the step returns its loss results on
    every device. Putting each microbatch's replicated first (as the driver once did)
    gathered every statistic once per microbatch."""
    model = get_model("wresnet", "tiny").with_value_and_grad(autopar.value_and_grad)
    # the stage's mesh the search chooses here (it splits the statistics), given: searching
    # the other meshes took a third of the test's time
    method = autopar.PipeshardParallel(num_microbatches=MICROBATCHES, num_stages=1,
                                       stages="uniform", layers=2, stage_mesh_shape=(4, 2),
                                       per_microbatch_statistics=True)
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    state, _ = step(state, batch)
    statistics = jax.tree_util.tree_leaves(state["batch_stats"])
    # the stage plan splits them (else nothing would need gathering and the test no point)
    assert any(spec.dims and any(spec.dims)
               for path, spec in step.get_plan(state, batch).stages[0].input_shardings.items()
               if "batch_stats" in path)
    emitted = step.get_hlo_collectives(state, batch)
    assert emitted["all-gather"]["count"] <= len(statistics), (emitted, len(statistics))


def test_a_scanned_models_report_counts_its_loop_bodies_per_layer(tmp_path, capsys):
    """A scanned GPT's layers are one loop: its collectives run once per layer, as its plan
    predicts them, and the report counts them so (statically, the body's would count once)."""
    doc_path = tmp_path / "report.json"
    code, _, err = run(["compile", "--model", "gpt-scan", "--size", "tiny", "--method", "shard",
                        "--devices", 8, "--json", doc_path], capsys)
    assert code == 0, err
    collectives = json.loads(doc_path.read_text())["collectives"]
    predicted, hlo = collectives["predicted"], collectives["hlo"]
    assert hlo["all-reduce"]["count"] > 0
    assert reduced_bytes(hlo) == pytest.approx(reduced_bytes(predicted), rel=0.1)
