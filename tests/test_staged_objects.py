"""The staged objects (``autopar.stages``): ``step.trace(...).plan().compile()`` is the path a
call takes, each stage a typed object a user can stop at; the compiled step owns donation.

A one-stage plan (ShardParallel on 4 devices) and a two-stage pipeline of the tiny MLP, each
compared with the serial ``jax.jit`` run, and with the plan the decorator makes for the same
arguments.
"""

import functools

import jax
import numpy as np
import pytest
from serial_reference import serial_run

import autopar
from autopar.compiler.graph.opgraph import OpGraph
from autopar.models import get_model
from autopar.runtime.executables import StepExecutable
from autopar.stages import Compiled, Planned, Traced

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 2
METHODS = {
    "shard": lambda: autopar.ShardParallel(mesh_shape=(1, 4)),
    "pipeline": lambda: autopar.PipeshardParallel(num_microbatches=2, stages="uniform",
                                                  num_stages=2, layers=2),
}


@functools.cache
def zoo():
    model = get_model("mlp", "tiny", num_layers=2)
    return model.with_value_and_grad(autopar.value_and_grad)


def batch(i):
    return zoo().make_batch(jax.random.key(10 + i))


def parallelized(name, **options):
    return autopar.parallelize(zoo().train_step, method=METHODS[name](), cache=False,
                               devices=jax.devices()[:4], **options)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_stages_run_the_serial_numbers_with_the_decorators_plan(name):
    step = parallelized(name)
    state = zoo().init_state(jax.random.key(0))
    traced = step.trace(state, batch(0))
    assert isinstance(traced, Traced) and isinstance(traced.graph, OpGraph)
    assert len(traced.graph.nodes) > 0
    planned = traced.plan()
    assert isinstance(planned, Planned) and not planned.from_cache
    assert planned.plan.is_pipelined == (name == "pipeline")
    compiled = planned.compile()
    assert isinstance(compiled, Compiled) and isinstance(compiled.executable, StepExecutable)
    assert compiled.executable.pipelined == (name == "pipeline")
    # the decorator plans the same arguments through the same stages: the same plan
    again = step.get_plan(state, batch(0)).to_dict()
    for field in ("method", "stages", "pipeline", "est_step_time_s", "signature"):
        assert again[field] == planned.plan.to_dict()[field], field

    ref_losses, ref_leaves = serial_run(zoo(), STEPS)
    for i in range(STEPS):
        state, loss = compiled(state, batch(i))
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6)
    for want, got in zip(ref_leaves, jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_a_compiled_step_refuses_another_signature_in_one_line():
    step = parallelized("shard")
    state = zoo().init_state(jax.random.key(0))
    compiled = step.trace(state, batch(0)).plan().compile()
    half = jax.tree_util.tree_map(lambda x: x[: x.shape[0] // 2], batch(0))
    with pytest.raises(autopar.InvalidOptionError) as info:
        compiled(state, half)
    assert "\n" not in str(info.value) and "signature" in str(info.value)


def test_a_one_stage_compiled_step_has_its_hlo_and_a_pipelined_one_says_why_not():
    state = zoo().init_state(jax.random.key(0))
    one = parallelized("shard").trace(state, batch(0)).plan().compile()
    assert "HloModule" in one.as_text()
    assert len(one.input_shardings()) == len(jax.tree_util.tree_leaves((state, batch(0))))
    piped = parallelized("pipeline").trace(state, batch(0)).plan().compile()
    with pytest.raises(autopar.InvalidOptionError, match="one program per stage task"):
        piped.as_text()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_compiled_step_releases_what_was_donated(name):
    # donation is the executable's: the inputs it did not hand back are deleted after the
    # call (XLA donates the one-stage program's; the pipeline drivers release theirs)
    step = parallelized(name, donate_argnums=(0,))
    state = zoo().init_state(jax.random.key(0))
    compiled = step.trace(state, batch(0)).plan().compile()
    new_state, _ = compiled(state, batch(0))
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(state)
               if isinstance(leaf, jax.Array))
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(new_state)
                   if isinstance(leaf, jax.Array))
    kept = batch(1)
    compiled(new_state, kept)
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(kept))


def test_recording_tasks_is_for_pipelines():
    state = zoo().init_state(jax.random.key(0))
    one = parallelized("shard").trace(state, batch(0)).plan().compile()
    with pytest.raises(autopar.InvalidOptionError, match="pipeline tasks"):
        one.executable(one.flat_inputs((state, batch(0))), record=True)
    piped = parallelized("pipeline").trace(state, batch(0)).plan().compile()
    piped.run((state, batch(0)), record=True)
    assert {r.stage for r in piped.executable.records} == {0, 1}
