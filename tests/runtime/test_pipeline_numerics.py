"""PipeshardParallel gives the serial numbers: GPT and MLP on 2 and 4 stages over 8 devices,
with every schedule (each schedule and stage count once, the models alternating).

Each case plans the zoo model (differentiated through ``autopar.value_and_grad``), runs 3 Adam
steps through the pipeline and compares the loss of every step and every updated state leaf
with plain ``jax.jit`` of the same step on one device (fp32). Microbatch gradients are averaged,
so for these mean losses the pipelined step is the full-batch step up to summation order.
"""

import functools

import jax
import numpy as np
import pytest
from serial_reference import serial_run as serial_losses_and_state

import autopar
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3
MODELS = {"gpt": {"num_layers": 4}, "mlp": {"num_layers": 4}}
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")
# Every schedule on 2 and on 4 stages, each pair once, the models alternating: the GPT (whose
# cases compile about four times as long) takes half, the MLP the other half, so each
# schedule runs both models and both stage counts (a suite-time decision, issue 34).
CASES = [(name, schedule, stages) for k, schedule in enumerate(SCHEDULES)
         for name, stages in (("gpt", 2 + 2 * (k % 2)), ("mlp", 4 - 2 * (k % 2)))]


def zoo(name):
    return get_model(name, "tiny", **MODELS[name]).with_value_and_grad(autopar.value_and_grad)


@functools.cache
def serial_run(name):
    """Losses and final state of the plain single-device jit step (computed once per model)."""
    return serial_losses_and_state(zoo(name), STEPS)


@pytest.mark.parametrize("name, schedule, stages", CASES,
                         ids=[f"{n}-{s}-{p}st" for n, s, p in CASES])
def test_pipeline_equals_serial(name, schedule, stages):
    model = zoo(name)
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    method = autopar.PipeshardParallel(
        num_microbatches=4, schedule=schedule, stages="uniform", num_stages=stages,
        layers=stages * chunks, num_chunks=max(chunks, 2),
    )
    step = autopar.parallelize(model.train_step, method=method)
    ref_losses, ref_leaves = serial_run(name)
    state = model.init_state(jax.random.key(0))
    for i in range(STEPS):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6)
    atol = 2e-3 * model.config.learning_rate
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    for path, want, got in zip(paths, ref_leaves, jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol, err_msg=path)
    plan = step.get_plan(state, model.make_batch(jax.random.key(0)))
    assert plan.method == "pipeshard" and len(plan.stages) == stages
    assert plan.pipeline.schedule == schedule
    # the stages use disjoint devices and together all eight
    ids = [d for st in plan.stages for d in st.device_ids]
    assert sorted(ids) == list(range(8))
    pieces = list(plan.pipeline.stage_of_piece)
    assert len(pieces) == stages * chunks
