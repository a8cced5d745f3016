"""``PipeshardParallel(schedule="auto")``: the planner compares schedules, and picks an
asynchronous one only with ``allow_async=True`` and only where its weight versions fit; the
steady-state estimate of the asynchronous schedules against the formulas; the report."""

import functools
import itertools

import pytest

import autopar
from autopar.compiler.inter_op.pipeline_cost import estimate_pipeline
from autopar.errors import InvalidOptionError, PlanError
from autopar.ir.schedule_timeline import stage_timeline
from autopar.models import get_model
from autopar.plan import Plan
from autopar.report.async_text import async_facts, async_lines, async_timeline
from autopar.report.swimlane import save_swimlane_png
from autopar.report.text import plan_timeline
from autopar.report.units import format_seconds

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

SYNC, ASYNC = {"1f1b", "zb-h1"}, {"pipedream", "pipedream-2bw"}


@functools.cache
def planned(allow_async, budget=None):
    model = get_model("mlp", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    method = autopar.PipeshardParallel(num_microbatches=4, schedule="auto",
                                       allow_async=allow_async, stages="uniform",
                                       num_stages=2, layers=2, memory_budget_bytes=budget)
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    return step.get_plan(*model.abstract_inputs())


def rows(plan):
    return {c["name"].removeprefix("schedule "): c for c in plan.planning.candidates}


def test_without_allow_async_only_synchronous_schedules_are_compared():
    plan = planned(False)
    assert set(rows(plan)) == SYNC
    assert plan.pipeline.schedule in SYNC


def test_with_allow_async_the_fastest_is_chosen_and_the_plan_says_what_it_changes():
    plan = planned(True)
    found = rows(plan)
    assert set(found) == SYNC | ASYNC
    fastest = min((c for c in found.values() if c["fits"]), key=lambda c: c["est_step_time_s"])
    assert fastest["chosen"] and plan.pipeline.schedule == fastest["name"].split()[-1]
    assert plan.est_step_time_s == fastest["est_step_time_s"]
    # on these stages the asynchronous schedules skip the fill and drain of every step
    assert all(found[a]["est_step_time_s"] < found["1f1b"]["est_step_time_s"] for a in ASYNC)
    assert plan.pipeline.schedule in ASYNC
    assert any("weight versions live per stage" in n and "staleness" in n for n in plan.notes)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.planning.method_options["allow_async"] is True


def test_an_asynchronous_schedule_is_not_chosen_where_its_versions_do_not_fit():
    sync = planned(False)
    budget = max(s.peak_memory_bytes for s in sync.stages) * 1.001  # 1F1B fits, barely
    plan = planned(True, budget)
    assert plan.pipeline.schedule in SYNC
    found = rows(plan)
    refused = [name for name in ASYNC if not found[name]["fits"]]
    assert refused, found  # stashing more weight versions does not fit this budget
    assert all("bytes per device" in found[name]["note"] for name in refused)
    for name, row in found.items():
        assert row["fits"] == (row["est_step_time_s"] is not None), name
    assert all(s.peak_memory_bytes <= budget for s in plan.stages)


def test_auto_and_allow_async_options_errors_are_one_line():
    with pytest.raises(InvalidOptionError, match="pipedream-2bw, auto"):
        autopar.PipeshardParallel(schedule="chimera")
    with pytest.raises(InvalidOptionError, match="allow_async"):
        autopar.PipeshardParallel(schedule="auto", allow_async="yes")


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 3), (8, 32)])
def test_steady_state_estimate_is_m_slowest_stages_per_step(p, m):
    """Equal stages of time t: a synchronous step takes (m + p - 1) t, an asynchronous one
    m t in its steady state. A stage's update of time u follows each of its backwards under
    PipeDream: every stage's slot becomes t + u. Under 2BW each stage updates once per step,
    each at its own moment: a step takes at least a stage's own work, m t + u, and at most
    that with every stage's update delaying the pipeline in turn, m t + p u."""
    t, u = 3.0, 0.5
    sync = estimate_pipeline("1f1b", m, [t] * p, [0.0] * p)
    assert sync.makespan_s == pytest.approx((m + p - 1) * t)
    for name in ("pipedream", "pipedream-2bw"):
        if name == "pipedream-2bw" and m < p - 1:
            continue
        free = estimate_pipeline(name, m, [t] * p, [0.0] * p)
        assert free.makespan_s == pytest.approx(m * t)
        assert free.idle_fraction == pytest.approx(0.0, abs=1e-9)
        assert sync.makespan_s / free.makespan_s == pytest.approx((m + p - 1) / m)
    assert estimate_pipeline("pipedream", m, [t] * p, [u] * p).makespan_s == \
        pytest.approx(m * (t + u))
    if m >= p - 1:
        step = estimate_pipeline("pipedream-2bw", m, [t] * p, [u] * p).makespan_s
        assert m * t + u - 1e-9 <= step <= m * t + p * u + 1e-9


def test_the_report_draws_the_steady_state_and_compares_with_1f1b(tmp_path):
    plan = planned(True)
    timeline = plan_timeline(plan)
    assert timeline.spans == async_timeline(plan).spans
    # three steps of m microbatches back to back: no flush between them, so the slowest
    # stage never waits from its first backward to the last step's last forward
    m, p = plan.num_microbatches, len(plan.stages)
    assert timeline.schedule.num_microbatches == 3 * m
    slowest = max(range(p), key=lambda s: plan.stages[s].est_time_s)
    spans = sorted(span for task, span in timeline.spans.items() if task.stage == slowest)
    first_b = min(span for task, span in timeline.spans.items()
                  if task.stage == slowest and task.kind.value == "B")
    last_f = max(span for task, span in timeline.spans.items()
                 if task.stage == slowest and task.kind.value == "F")
    window = [(a, b) for a, b in spans if first_b[0] <= a and b <= last_f[1]]
    assert all(b1 == pytest.approx(a2) for (_, b1), (a2, _) in itertools.pairwise(window))
    facts = async_facts(plan)
    one_f_one_b = stage_timeline("1f1b", [s.est_time_s for s in plan.stages], m).makespan
    assert facts["throughput_vs_1f1b"] == pytest.approx(one_f_one_b
                                                        / facts["schedule_s_per_step"])
    assert facts["throughput_vs_1f1b"] > 1.0
    lines = "\n".join(async_lines(plan, format_seconds))
    assert "weight versions live per stage" in lines and "staleness" in lines
    assert f"{facts['throughput_vs_1f1b']:.2f}x 1f1b's" in lines
    path = tmp_path / "async.png"
    save_swimlane_png(timeline, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_schedule_plans_names_each_reason():
    with pytest.raises(PlanError, match="schedule='auto' found no schedule"):
        planned(True, 1.0)


def test_the_command_line_allows_async_and_draws_the_steady_state(tmp_path, capsys):
    from autopar.cli.main import main

    png = tmp_path / "lane.png"
    argv = ["compile", "--model", "mlp", "--devices", "8", "--method", "pipeshard",
            "--schedule", "auto", "--allow-async", "--stages", "uniform", "--num-stages", "2",
            "--pipeline-layers", "2", "--swimlane", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "schedule pipedream-2bw" in out and "schedule 1f1b" in out
    assert "3 steps back to back" in out and "throughput" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["compile", "--model", "gpt", "--devices", "8", "--method", "data",
                 "--allow-async"]) != 0
    assert "--allow-async applies to --method pipeshard" in capsys.readouterr().err


def test_only_the_chosen_schedule_has_its_stages_solved_whole(monkeypatch):
    # every schedule is searched, and its estimate compared; the stage plans solved whole
    # (an ILP per stage) do not change an estimate, so only the kept one is finished
    from autopar.compiler.planners import schedule_choice

    finished = []
    real = schedule_choice.finish_pipeshard

    def counting(search, *args, **kwargs):
        finished.append(search.method.schedule)
        return real(search, *args, **kwargs)

    monkeypatch.setattr(schedule_choice, "finish_pipeshard", counting)
    model = get_model("mlp", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    method = autopar.PipeshardParallel(num_microbatches=4, schedule="auto", allow_async=True,
                                       stages="uniform", num_stages=2, layers=2)
    plan = autopar.parallelize(model.train_step, method=method,
                               cache=False).get_plan(*model.abstract_inputs())
    assert len(rows(plan)) == 4 and sum(r["fits"] for r in rows(plan).values()) >= 2
    assert finished == [plan.pipeline.schedule]
