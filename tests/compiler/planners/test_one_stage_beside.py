"""The full search's ShardParallel candidates planned in a forked child beside the pipelines
(``planners.one_stage_beside``): the same plan and the same record of candidates as planned
one after the other, also where the child could not plan a candidate (it would have had to
trace) or failed. Pure planning on a described cluster; nothing is timed."""

import dataclasses
import functools
import os

import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.inter_op import forked
from autopar.compiler.planners import dispatch, one_stage_beside
from autopar.models import get_model


def cluster():
    return load_cluster("a100-80gb-x8").with_devices(2, 2)


def search(monkeypatch, *, beside: bool, **options):
    """The full search of a 2-layer GPT on 2 hosts of 2; with ``beside`` its ShardParallel
    candidates are planned in a child (the size threshold lowered to this small step). The
    plan and how many children were started."""
    monkeypatch.setattr(one_stage_beside, "BESIDE_MIN_NODES", 0 if beside else 10**9)
    started = []
    real = one_stage_beside.start

    def counted(*args):
        started.append(1)
        return real(*args)

    monkeypatch.setattr(one_stage_beside, "start", counted)
    model = get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    method = autopar.AutoParallel(num_microbatches=4, planning_workers=2, prune=False, **options)
    step = dispatch.trace(model.train_step, model.abstract_inputs(), method, (1,))
    return dispatch.plan(step, cluster()).plan, len(started)


def record(plan):
    """The candidates compared, without timings: name, estimate, whether it fits, note."""
    return [(r["name"], r.get("est_step_time_s"), r.get("fits"), r.get("note"))
            for r in plan.planning.candidates]


def assert_same(a, b):
    assert a.method == b.method and a.est_step_time_s == b.est_step_time_s
    assert a.shardings() == b.shardings()
    assert record(a) == record(b)
    assert {k for k in a.planning.phases} == {k for k in b.planning.phases}


@functools.cache
def serial_search(**options):
    """The search with every candidate planned here (computed once per options)."""
    with pytest.MonkeyPatch.context() as mp:
        plan, children = search(mp, beside=False, **options)
    assert children == 0
    return plan


def test_the_shard_candidates_beside_the_pipelines_give_the_serial_search():
    serial = serial_search()
    with pytest.MonkeyPatch.context() as mp:
        parallel, children = search(mp, beside=True)
    assert children == 1
    shard_rows = [r for r in parallel.planning.candidates if r["name"].startswith("shard")]
    assert shard_rows and all(r.get("est_step_time_s") is not None for r in shard_rows)
    assert_same(parallel, serial)


def test_a_candidate_the_child_would_have_to_trace_is_planned_here():
    """``remat="layers"``: the candidates plan the rematerialised step. Not traced before the
    fork, the child raises ``TraceNeeded`` for each and this process plans them itself."""
    only = {"remat": "layers", "candidates": ("shard", "pipeshard")}  # no other traces it
    serial = serial_search(**only)
    answers = []
    real_join = forked.Beside.join

    def join(self):
        answers.append(real_join(self))
        return answers[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(one_stage_beside, "trace_first", lambda *args: None)
        mp.setattr(forked.Beside, "join", join)
        parallel, children = search(mp, beside=True, **only)
    assert children == 1
    outcomes = answers[0][0]
    assert outcomes and all(o.in_parent and o.plan is None for o in outcomes)
    assert any(r.get("note", "").startswith("rematerialised")
               for r in parallel.planning.candidates if r["name"].startswith("shard"))
    assert_same(parallel, serial)


def test_a_failed_child_leaves_its_candidates_to_this_process():
    serial = serial_search()
    with pytest.MonkeyPatch.context() as mp:
        def failing(work):
            return forked.start_beside(lambda: 1 / 0)

        mp.setattr(one_stage_beside, "start_beside", failing)
        parallel, children = search(mp, beside=True)
    assert children == 1
    assert_same(parallel, serial)


def keep_children(monkeypatch):
    """The children the search starts (``forked.Beside``), in a list that fills as it runs."""
    children = []
    real = forked.start_beside

    def kept(work):
        children.append(real(work))
        return children[-1]

    monkeypatch.setattr(one_stage_beside, "start_beside", kept)
    return children


@pytest.mark.parametrize("started", [True, False], ids=["child-started", "before-the-child"])
def test_the_child_is_ended_when_the_pipelines_fail(monkeypatch, started):
    """A pipeline search that raises (here: a bug stands in) ends the child, not leaves it.
    The stage search starts the child while its first forked ILPs run (``meanwhile``): one
    that fails after that ends it, one that fails before it leaves none started."""
    children = keep_children(monkeypatch)
    def broken(*args, meanwhile=None, **kwargs):
        if started:
            meanwhile()
        raise RuntimeError("pipelines failed")

    monkeypatch.setattr(dispatch, "_plan_pipelined", broken)
    with pytest.raises(RuntimeError, match="pipelines failed"):
        search(monkeypatch, beside=True)
    assert len(children) == (1 if started else 0)
    for child in children:
        with pytest.raises(ChildProcessError):  # reaped: no such child any more
            os.waitpid(child.pid, 0)


def test_which_searches_plan_beside(monkeypatch):
    """Only a large step, with two workers, no ILP observer, no time budget, and no one-stage
    plan that could prune the pipelines (the tiny GPT's flops take nanoseconds at the peak:
    with ``prune`` on, its one-stage plans may leave the pipelines unplanned)."""
    model = get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    method = autopar.AutoParallel(num_microbatches=4, planning_workers=2, prune=False)
    step = dispatch.trace(model.train_step, model.abstract_inputs(), method, (1,))
    where = cluster()

    def beside(m, observer=None, deadline=None):
        return one_stage_beside.plans_beside(step, m, where, observer, deadline)

    assert not beside(method)  # too small
    monkeypatch.setattr(one_stage_beside, "BESIDE_MIN_NODES", 0)
    assert beside(method)
    assert not beside(dataclasses.replace(method, planning_workers=1))
    assert not beside(method, observer=lambda *a: None)
    assert not beside(method, deadline=1e9)
    assert not beside(dataclasses.replace(method, prune=True))


def test_the_child_is_ended_when_waiting_for_it_is_interrupted(monkeypatch):
    """Ctrl-C while the pipelines' planner waits for the child: the child is ended too."""
    children = keep_children(monkeypatch)
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(forked.Beside, "join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        search(monkeypatch, beside=True)
    assert len(children) == 1
    with pytest.raises(ChildProcessError):
        os.waitpid(children[0].pid, 0)
