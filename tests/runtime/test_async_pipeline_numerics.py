"""Asynchronous pipelines compute their algorithm: PipeDream with weight stashing and
PipeDream-2BW on 2 and 4 stages of 8 devices, for the MLP and GPT tiny, over 4 calls.

The expected numbers come from ``async_reference`` (plain JAX on one device, written from the
algorithms' definitions), not from the synchronous step: staleness is part of the algorithm.
Which stage owns each parameter is the plan's choice, read from the stages' input leaves.
Without weight stashing (the runner's test switch) the same run leaves the reference, which
shows that stashing is what makes it match.
"""

import functools

import jax
import numpy as np
import pytest
from async_reference import pipedream_2bw_reference, pipedream_reference

import autopar
from autopar.models import get_model
from autopar.runtime.async_pipeline import AsyncPipelineRunner

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

CALLS = 4
M = 4
MODELS = {"mlp": {"num_layers": 4}, "gpt": {"num_layers": 2}}
REFERENCES = {"pipedream": pipedream_reference, "pipedream-2bw": pipedream_2bw_reference}
CASES = [(s, p) for s in REFERENCES for p in (2, 4)]


def zoo(name):
    return get_model(name, "tiny", **MODELS[name]).with_value_and_grad(autopar.value_and_grad)


def batches(model):
    return [model.make_batch(jax.random.key(10 + i)) for i in range(CALLS)]


def owners(plan):
    """Each parameter's owning stage: the first stage whose inputs hold it."""
    found = {}
    for stage in plan.stages:
        for path in stage.input_shardings:
            if path.startswith("state/params/"):
                found.setdefault(path.removeprefix("state/params/"), stage.index)
    return found


@functools.cache
def async_run(name, schedule, stages):
    """The step, its plan and the losses and final state of CALLS calls."""
    model = zoo(name)
    method = autopar.PipeshardParallel(num_microbatches=M, schedule=schedule, stages="uniform",
                                       num_stages=stages, layers=stages)
    step = autopar.parallelize(model.train_step, method=method)
    state, losses = model.init_state(jax.random.key(0)), []
    for batch in batches(model):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return step, step.get_plan(state, batches(model)[0]), losses, state


@functools.cache
def reference(name, schedule, stages):
    model = zoo(name)
    _, plan, _, _ = async_run(name, schedule, stages)
    return REFERENCES[schedule](model.loss_fn, model.optimizer, model.init_state(jax.random.key(0)),
                                batches(model), owners(plan), stages, M)


@functools.cache
def sync_run(name):
    """The final state of CALLS synchronous steps (plain ``jax.jit``) from the same state and
    batches: one per model, whichever schedule it is set beside."""
    model = zoo(name)
    step = jax.jit(model.train_step)
    sync = model.init_state(jax.random.key(0))
    for batch in batches(model):
        sync, _ = step(sync, batch)
    return sync


def deviation(state, want, lr):
    """Largest difference of any state leaf from the reference, in learning rates."""
    pairs = zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(want), strict=True)
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs) / lr


@pytest.mark.parametrize("schedule, stages", CASES, ids=[f"{s}-{p}st" for s, p in CASES])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_async_pipeline_equals_its_reference(name, schedule, stages):
    model = zoo(name)
    _, plan, losses, state = async_run(name, schedule, stages)
    assert plan.pipeline.schedule == schedule and len(plan.stages) == stages
    want_losses, want_state = reference(name, schedule, stages)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert deviation(state, want_state, model.config.learning_rate) < 2e-3
    # the algorithm is not the synchronous one: the reference itself moved away from it
    assert deviation(sync_run(name), want_state, model.config.learning_rate) > 0.1


@pytest.mark.parametrize("schedule", sorted(REFERENCES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_without_weight_stashing_the_result_leaves_the_reference(name, schedule):
    stages = 2
    model = zoo(name)
    step, plan, _, _ = async_run(name, schedule, stages)
    compiled = step._compiled((model.init_state(jax.random.key(0)), batches(model)[0]))
    runner = AsyncPipelineRunner.from_plan(compiled.executable.runner.pp, plan, jax.devices(),
                                           stash_weights=False)
    out_tree = compiled.executable.runner.pp.outer.out_tree
    state = model.init_state(jax.random.key(0))
    for batch in batches(model):
        state, _ = jax.tree.unflatten(out_tree, runner(jax.tree.leaves((state, batch))))
    _, want_state = reference(name, schedule, stages)
    assert deviation(state, want_state, model.config.learning_rate) > 0.05


def test_a_donated_state_keeps_the_versions_the_pipeline_still_reads():
    """Stage 0 still reads the weights a call was given (its microbatches in flight): donating
    the state must not free them; the run is the undonated one."""
    model = zoo("mlp")
    _, _, losses, state = async_run("mlp", "pipedream", 4)
    method = autopar.PipeshardParallel(num_microbatches=M, schedule="pipedream",
                                       stages="uniform", num_stages=4, layers=4)
    step = autopar.parallelize(model.train_step, method=method, donate_argnums=(0,))
    donated, got = model.init_state(jax.random.key(0)), []
    for batch in batches(model):
        given = donated
        donated, loss = step(donated, batch)
        got.append(float(loss))
    assert got == losses
    assert deviation(donated, state, model.config.learning_rate) == 0.0
    # what the pipeline does not hold was freed, as jax.jit's donation does
    assert any(leaf.is_deleted() for leaf in jax.tree.leaves(given))
