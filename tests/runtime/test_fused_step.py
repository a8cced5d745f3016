"""A one-stage pipeline run as one program (``runtime.fused_step``, the runtime's default for
one stage): the serial numbers, one logged program per step whose collectives are
the step's, one timed record per step."""

import functools
import re

import jax
import numpy as np
import pytest
from hlo_loops import program_while_lines
from serial_reference import assert_runner_matches_serial

import autopar
from autopar.compiler.planners.pipeshard import plan_pipeshard
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.runtime.fused_step import FusedStep
from autopar.runtime.hlo import count_collectives
from autopar.runtime.local_cluster import local_cluster
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.pipeline_hlo import step_collectives

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 2
M = 4
CASES = [("gpt", "1f1b"), ("mlp", "gpipe"), ("mlp", "zb-h1")]


@functools.cache
def one_stage(name, schedule):
    """A zoo model's inputs, its pipeline program and one-stage plan (M microbatches, 2
    layers): GPT's with 1F1B is read by two tests, built once per process."""
    model = get_zoo(name)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(10))
    method = autopar.PipeshardParallel(num_microbatches=M, schedule=schedule, num_stages=1,
                                       stages="uniform", layers=2)
    pp = build_pipeline_program(model.train_step, (state, batch), (1,), M)
    return model, state, batch, pp, plan_pipeshard(pp, method, local_cluster())


@pytest.mark.parametrize("name, schedule", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_one_stage_pipeline_as_one_program_has_the_serial_numbers(name, schedule):
    model, state, batch, pp, plan = one_stage(name, schedule)
    assert len(plan.stages) == 1
    runner = PipelineRunner.from_plan(pp, plan, jax.devices(), fuse=True)
    assert isinstance(runner.fused, FusedStep)
    assert_runner_matches_serial(runner, pp.outer.out_tree, model, STEPS)

    flat = jax.tree_util.tree_leaves((state, batch))
    # the step is one program, called once
    counted = step_collectives(runner, flat)
    assert [(p.label, p.stage, p.calls) for p in counted.programs] == [("step", 0, 1)]
    # timed: one record, the whole step's program over every microbatch
    out = runner(flat, record=True)
    assert np.isfinite(float(jax.tree_util.tree_unflatten(pp.outer.out_tree, out)[1]))
    assert [(r.kind, r.microbatch, r.stage) for r in runner.records] == [("step", -1, 0)]
    assert runner.records[0].end_s >= runner.records[0].start_s == 0.0


def test_one_stage_pipeline_is_one_program_unless_told_otherwise():
    model = get_zoo("mlp")
    method = autopar.PipeshardParallel(num_microbatches=M, num_stages=1, stages="uniform",
                                       layers=2)
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(1))
    # the default: the whole step, every microbatch's tasks in it, is one logged program
    labels = [program.label for program in step.pipeline_collectives(state, batch).programs]
    assert labels == ["step"]
    # fuse=False: a forward and a backward per microbatch; the batch cut once per split input
    pp = build_pipeline_program(model.train_step, (state, batch), (1,), M)
    plan = step.get_plan(state, batch)
    runner = PipelineRunner.from_plan(pp, plan, jax.devices(), fuse=False)
    assert runner.fused is None
    logged = []
    runner(jax.tree_util.tree_leaves((state, batch)), calls=logged)
    calls: dict[str, int] = {}
    for call in logged:
        calls[call.label] = calls.get(call.label, 0) + 1
    assert calls["F0"] == calls["B0"] == M
    assert all(n == 1 for label, n in calls.items() if label.startswith("microbatches"))


def get_zoo(name):
    from autopar.models import get_model

    return get_model(name, "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)


def test_later_microbatches_run_as_one_loop_that_emits_what_the_unrolled_step_does():
    """The microbatches after the first run as one loop (``runtime.fused_step``): the step's
    program holds a while loop of M - 1 iterations, its results are the unrolled program's,
    and its collectives counted per run are the unrolled program's too."""
    # 1F1B is PipeshardParallel's default schedule
    _, state, batch, pp, plan = one_stage("gpt", "1f1b")
    flat = jax.tree_util.tree_leaves((state, batch))
    looped = PipelineRunner.from_plan(pp, plan, jax.devices())
    unrolled = PipelineRunner.from_plan(pp, plan, jax.devices())
    unrolled.fused = FusedStep(unrolled, loop=False)
    texts = []
    for runner in (looped, unrolled):
        calls = []
        runner(flat, calls=calls)
        (call,) = calls
        texts.append(call.fn.lower(*call.args).compile().as_text())
    loops = program_while_lines(texts[0])
    assert [re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', x) for x in loops] == [
        [str(M - 1)]]
    assert program_while_lines(texts[1]) == []
    for got, want in zip(looped(flat), unrolled(flat), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    emitted = [step_collectives(r, flat).by_kind() for r in (looped, unrolled)]
    assert emitted[0]["all-reduce"]["count"] > count_collectives(texts[0]).by_kind()[
        "all-reduce"]["count"]  # the loop's body counts once per microbatch it runs
    for kind, counted in emitted[1].items():
        assert emitted[0][kind]["bytes"] == counted["bytes"], kind
