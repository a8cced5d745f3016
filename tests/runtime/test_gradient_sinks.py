"""A parameter's gradient contraction whose plan splits what it sums over
(``runtime.gradient_sinks``): its partial sums are kept per group over the microbatches and
reduced once per step, as the stage's plan prices it, through a view of the parameter (GPT's
tied embedding is read transposed by the head), with every schedule's backward (fused, split
into input and weight halves) and in recomputed stages; and the step still gives the serial
numbers."""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest
from serial_reference import assert_runner_matches_serial

import autopar
from autopar.compiler.planners.pipeshard import plan_pipeshard
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model
from autopar.runtime.local_cluster import local_cluster
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.pipeline_hlo import step_collectives

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

M = 2
STEPS = 2


@functools.cache
def planned(remat="none"):
    """GPT tiny in two tensor-parallel stages of 4 devices: the last stage's plan makes the
    tied embedding's gradient from the microbatch split over its 4 devices, while its
    forward splits the vocabulary, so no batch split meets the parameter there
    (``runtime.param_copies`` cannot take it)."""
    model = get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    state, batch = model.init_state(jax.random.key(0)), model.make_batch(jax.random.key(10))
    method = autopar.PipeshardParallel(num_microbatches=M, num_stages=2, stages="uniform",
                                       layers=2, remat=remat)
    pp = build_pipeline_program(model.train_step, (state, batch), (1,), M)
    return model, state, batch, pp, plan_pipeshard(pp, method, local_cluster(jax.devices()))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_gradient_contractions_partial_sums_are_reduced_once_per_step(schedule):
    model, state, batch, pp, plan = planned()
    plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline,
                                                                  schedule=schedule))
    runner = PipelineRunner.from_plan(pp, plan, jax.devices())
    last = runner.tasks[-1]
    assert last.sinks and not last.copies.params
    wte = next(s for s in last.sinks if s.chain)  # the head reads the embedding transposed
    assert wte.axes == (("x",),) and wte.shape == state["params"]["wte"].shape

    flat = jax.tree_util.tree_leaves((state, batch))
    st = runner.new_state(flat)
    runner.run_step(st)
    # one accumulator per parameter: the rest of a sunk parameter's gradient is folded into
    # its sink's first block, not kept beside it
    assert len(st.accum[len(runner.tasks) - 1]) == len(last.params)
    emitted = step_collectives(runner, flat)
    # every stage reduces what its plan predicts (under ZB-H1 the weight task derives the
    # backward again, with its activation gradients' reductions, which no plan counts)
    for s, stage in enumerate(plan.stages if schedule == "1f1b" else ()):
        predicted = sum(c.nbytes for c in stage.collectives if c.kind.value == "all-reduce")
        assert emitted.by_kind(s)["all-reduce"]["bytes"] == pytest.approx(predicted,
                                                                         rel=1e-6)
    # the sinks off, the last stage reduces that gradient in each microbatch's backward
    per_microbatch = PipelineRunner.from_plan(pp, plan, jax.devices(), param_copies=False)
    assert not per_microbatch.tasks[-1].sinks
    more = step_collectives(per_microbatch, flat).by_kind(1)["all-reduce"]["bytes"]
    assert more == emitted.by_kind(1)["all-reduce"]["bytes"] + (M - 1) * wte_bytes(state)

    assert_runner_matches_serial(runner, pp.outer.out_tree, model, STEPS)


def wte_bytes(state) -> int:
    wte = state["params"]["wte"]
    return wte.size * wte.dtype.itemsize


def all_reduced(programs, label):
    return [p.summary.by_kind()["all-reduce"]["bytes"] for p in programs if p.label == label]


def test_a_recomputed_stage_runs_its_layers_as_the_plan_does_and_its_forward_twice():
    """``remat="layers"``: each layer's checkpoint runs its equations held and bound as the
    stage's unrecomputed forward does (they ran as XLA liked, Wide-ResNet's stages then
    gathering 98 KB their plan does not), so the sinks reduce once per step there too, and
    the last stage's backward emits what the unrecomputed backward does plus some of its
    forward's reductions again, nothing else."""
    model, state, batch, pp, plan = planned("layers")
    assert all(plan.pipeline.remat_stages)
    runner = PipelineRunner.from_plan(pp, plan, jax.devices())
    assert runner.tasks[-1].sinks
    flat = jax.tree_util.tree_leaves((state, batch))
    recomputed = step_collectives(runner, flat).programs
    plain = step_collectives(PipelineRunner.from_plan(pp, planned()[4], jax.devices()),
                             flat).programs
    assert plan.stages[1].tensor_shardings == planned()[4].stages[1].tensor_shardings
    (forward,) = set(all_reduced(recomputed, "F1"))
    (backward,) = set(all_reduced(plain, "B1"))
    (both,) = set(all_reduced(recomputed, "B1"))
    # what the recomputed forward needs of its reductions (not the loss's: its backward
    # starts from the loss's cotangent), no more
    assert backward < both <= backward + forward
    assert all_reduced(recomputed, "sum1") == all_reduced(plain, "sum1") == [wte_bytes(state)]
    assert_runner_matches_serial(runner, pp.outer.out_tree, model, STEPS)
