"""A one-stage pipeline runs as one program (``runtime.fused_step``): the serial numbers, one
logged program per step whose collectives are the step's, one timed record per step."""

import jax
import numpy as np
import pytest
from serial_reference import serial_run

import autopar
from autopar.models import get_model

STEPS = 2
CASES = [("gpt", "1f1b"), ("mlp", "gpipe"), ("mlp", "zb-h1")]


@pytest.mark.parametrize("name, schedule", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_one_stage_pipeline_is_one_program_with_the_serial_numbers(name, schedule):
    model = get_model(name, "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    method = autopar.PipeshardParallel(num_microbatches=4, schedule=schedule, num_stages=1,
                                       stages="uniform", layers=2)
    step = autopar.parallelize(model.train_step, method=method, cache=False)
    ref_losses, ref_leaves = serial_run(model, STEPS)
    state = model.init_state(jax.random.key(0))
    for i in range(STEPS):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6)
    atol = 2e-3 * model.config.learning_rate
    for want, got in zip(ref_leaves, jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)

    batch = model.make_batch(jax.random.key(0))
    plan = step.get_plan(state, batch)
    assert plan.method == "pipeshard" and len(plan.stages) == 1
    # the step is one program, called once: its collectives are the step's
    counted = step.pipeline_collectives(state, batch)
    assert [(p.label, p.stage, p.calls) for p in counted.programs] == [("step", 0, 1)]
    assert step.get_hlo_collectives(state, batch) == counted.by_kind()
    # timed: one record, the whole step's program over every microbatch
    (_, loss), records = step.timed_call(state, batch)
    assert np.isfinite(float(loss))
    assert [(r.kind, r.microbatch, r.stage) for r in records] == [("step", -1, 0)]
    assert records[0].end_s >= records[0].start_s == 0.0
