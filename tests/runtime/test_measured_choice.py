"""Measured candidates (``AutoParallel.measure_candidates``, ``runtime/measured_choice``): on
the devices the step runs on, the full search times its choice beside the simple plans and
keeps the fastest measured. The clock is replaced here by fixed times (no test compares two
wall-clock measurements): what is checked is which candidates are timed, what is kept, what
the plan records, that the kept plan gives the serial numbers, and that a cached plan is not
timed again."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

import autopar
from autopar.errors import InvalidOptionError
from autopar.models import get_model
from autopar.runtime import measured_choice
from autopar.runtime.measured_choice import CLOCK_MARGIN, Candidate, kept_by_clock, to_measure


def _candidate(name: str, est: float, pipelined: bool = False, plan=None) -> Candidate:
    plan = plan or SimpleNamespace(est_step_time_s=est,
                                   pipeline=SimpleNamespace(schedule="1f1b") if pipelined
                                   else None)
    return Candidate(name, plan, program=None)


def test_the_choice_and_the_simple_plans_are_timed_first():
    chosen = _candidate("shard 4x2", 1.0)
    others = [_candidate("zero2", 1.1), _candidate("shard", 1.2), _candidate("data", 3.0),
              _candidate("shard 2x4", 1.01), _candidate("zero3", 1.05),
              _candidate("pipeshard", 0.9, pipelined=True)]
    names = [c.name for c in to_measure(chosen, others, 3)]
    # DataParallel() and ShardParallel() (the 1-D mesh), though others are estimated faster
    assert names == ["shard 4x2", "data", "shard"]
    assert [c.name for c in to_measure(chosen, others, 5)] == [
        "shard 4x2", "data", "shard", "shard 2x4", "zero3"]  # one-stage plans only
    assert [c.name for c in to_measure(chosen, others, 1)] == ["shard 4x2"]


def test_a_plan_under_two_names_is_timed_once():
    chosen = _candidate("shard", 1.0)
    twin = _candidate("shard 2x4", 1.0, plan=chosen.plan)
    names = [c.name for c in to_measure(chosen, [twin, _candidate("data", 2.0)], 3)]
    assert names == ["shard", "data"]


def test_the_clock_replaces_the_searchs_choice_only_by_more_than_its_margin():
    chosen, data, zero2 = (_candidate(n, 1.0) for n in ("shard", "data", "zero2"))
    timed = [chosen, data, zero2]
    close = 1.0 - CLOCK_MARGIN / 2  # within the margin: noise, the choice stays
    assert kept_by_clock(chosen, timed, {"shard": 1.0, "data": close, "zero2": 1.2}) is chosen
    beyond = 1.0 - 2 * CLOCK_MARGIN
    assert kept_by_clock(chosen, timed, {"shard": 1.0, "data": close,
                                         "zero2": beyond}) is zero2
    assert kept_by_clock(chosen, timed, {"shard": 0.9, "data": 1.0, "zero2": 1.1}) is chosen


def test_an_asynchronous_choice_is_not_timed():
    chosen = Candidate("pipeshard", SimpleNamespace(
        est_step_time_s=1.0, pipeline=SimpleNamespace(schedule="pipedream")), None)
    assert [c.name for c in to_measure(chosen, [_candidate("data", 2.0)], 3)] == ["pipeshard"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_measure_candidates_must_be_a_count(bad):
    with pytest.raises(InvalidOptionError, match="measure_candidates"):
        autopar.AutoParallel(measure_candidates=bad)


@pytest.fixture(scope="module")
def gpt():
    model = get_model("gpt", "tiny")
    key = jax.random.key(0)
    return model, model.init_state(key), model.make_batch(jax.random.key(1))


def _fixed_clock(monkeypatch, fastest: str):
    """Every executable of a ``fastest`` plan times 1 ms, every other 5 ms; the calls made
    are recorded by plan method."""
    calls = []
    real_build = measured_choice.build_executable

    def build(plan, *args, **kwargs):
        executable = real_build(plan, *args, **kwargs)
        executable.timed_method = plan.method.value
        return executable

    def clock(executables, template, rounds=None):
        calls.extend(e.timed_method for e in executables)
        return [1e-3 if e.timed_method == fastest else 5e-3 for e in executables]

    monkeypatch.setattr(measured_choice, "build_executable", build)
    monkeypatch.setattr(measured_choice, "time_executables", clock)
    return calls


@pytest.mark.e2e
def test_the_fastest_measured_plan_is_kept_and_runs_the_serial_numbers(gpt, monkeypatch):
    model, state, batch = gpt
    calls = _fixed_clock(monkeypatch, fastest="data")
    step = autopar.parallelize(model.train_step, cache=False)
    plan = step.get_plan(state, batch)
    assert len(calls) == 3 and "data" in calls and "shard" in calls
    assert plan.method.value == "data"  # the estimate preferred a ShardParallel plan
    rows = plan.planning.candidates
    chosen = [r for r in rows if r.get("chosen")]
    assert [r["name"] for r in chosen] == ["data"]
    assert chosen[0]["measured_step_time_s"] == pytest.approx(1e-3)
    assert sum("measured_step_time_s" in r for r in rows) == 3
    assert plan.notes[0].startswith("measured on these devices") and "kept data" in plan.notes[0]
    assert plan.planning.method_options["chosen"] == "data"
    # the kept plan runs, and gives the serial step's numbers
    loss, new_state = step(state, batch)[1], step(state, batch)[0]
    want = jax.jit(model.train_step)(state, batch)
    assert float(loss) == pytest.approx(float(want[1]), rel=1e-5)
    for got, ref in zip(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(want[0]),
                        strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=1e-6)


@pytest.mark.e2e
def test_the_searchs_choice_kept_when_it_is_fastest_and_a_cached_plan_is_not_timed(
        gpt, monkeypatch, tmp_path):
    model, state, batch = gpt
    calls = _fixed_clock(monkeypatch, fastest="shard")
    plan = autopar.parallelize(model.train_step, cache=tmp_path).get_plan(state, batch)
    assert plan.method.value == "shard" and "the search's choice is the fastest" in plan.notes[0]
    timed = len(calls)
    again = autopar.parallelize(model.train_step, cache=tmp_path)
    assert again.get_plan(state, batch).notes[0] == plan.notes[0]
    assert again.plan_was_cached(state, batch) and len(calls) == timed


@pytest.mark.e2e
def test_measure_candidates_zero_times_nothing(gpt, monkeypatch):
    model, state, batch = gpt
    calls = _fixed_clock(monkeypatch, fastest="data")
    method = autopar.AutoParallel(measure_candidates=0)
    plan = autopar.parallelize(model.train_step, method=method, cache=False).get_plan(
        state, batch)
    assert not calls
    assert not any("measured_step_time_s" in r for r in plan.planning.candidates)
