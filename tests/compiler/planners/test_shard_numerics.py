"""ShardParallel on every zoo model and mesh shape: the same numbers as the serial step.

Each case plans with the ILP, runs 3 Adam steps on the plan's devices and compares loss and
every updated state leaf with plain ``jax.jit`` on one device (fp32). It also checks that the
communication the plan predicts is what XLA emitted, per collective kind, where XLA's choice is
stable: all-reduce bytes within 10% everywhere, all-gather bytes within 10% except the cases
named below.
"""

import functools

import jax
import numpy as np
import pytest
from serial_reference import serial_run as serial_losses_and_state

import autopar
from autopar.models import MODEL_NAMES, get_model
from autopar.runtime.hlo import count_collectives

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

MESHES = [(1, 4), (4, 1), (2, 2), (2, 4)]
# Every model on every mesh, but Wide-ResNet, the slowest to compile (its convolutions), on one
# 1-D and one 2-D mesh only: its convolutions on 2x2 are the hand-plan oracle's (conv-bn), and
# 4x1 is 1x4's other orientation (a suite-time decision, issue 34).
CASES = [(name, mesh) for name in MODEL_NAMES for mesh in MESHES
         if name != "wresnet" or mesh in ((1, 4), (2, 4))]
STEPS = 3
# Parameters after 3 Adam steps may differ by this fraction of the learning rate: see
# ZooModel.optimizer. Wide-ResNet's batch norm divides by each step's batch statistics, which
# amplifies reduction-order rounding from step to step (its first-step gradients agree with the
# serial ones to about 1e-5 relative; by step 3 a few weights differ by ~1% of a step), so it
# gets a wider bound.
PARAM_ATOL_IN_LR = {"mlp": 2e-3, "gpt": 2e-3, "moe": 2e-3, "wresnet": 2e-2, "llama": 2e-3}


@functools.cache
def serial_run(name):
    """Losses and final state of the plain single-device jit step (computed once per model)."""
    return serial_losses_and_state(get_model(name, "tiny"), STEPS)


@pytest.mark.parametrize("name, mesh", CASES, ids=[f"{n}-{m[0]}x{m[1]}" for n, m in CASES])
def test_shard_parallel_equals_serial(name, mesh):
    model = get_model(name, "tiny")
    n = mesh[0] * mesh[1]
    # a generous time limit: GPT's 2x4 ILP takes ~15 s to prove optimal on 2 busy cores, and
    # the status is asserted below
    step = autopar.parallelize(
        model.train_step, method=autopar.ShardParallel(mesh_shape=mesh, time_limit_s=300),
        devices=jax.devices()[:n],
    )
    ref_losses, ref_leaves = serial_run(name)
    state = model.init_state(jax.random.key(0))
    par = state
    for i in range(STEPS):
        batch = model.make_batch(jax.random.key(10 + i))
        par, loss = step(par, batch)
        assert float(loss) == pytest.approx(ref_losses[i], rel=1e-5, abs=1e-6)
    atol = PARAM_ATOL_IN_LR[name] * model.config.learning_rate
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(par)]
    for path, want, got in zip(paths, ref_leaves, jax.tree_util.tree_leaves(par), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol, err_msg=path)
    plan = step.get_plan(state, batch)
    assert plan.method == "shard" and plan.solver["status"] in ("optimal", "trivial")
    hlo = count_collectives(step.get_hlo_text(state, batch))
    # CPU XLA turns a planned reduce-scatter into an all-reduce plus a slice
    predicted = sum(
        c.nbytes
        for c in plan.stages[0].collectives
        if c.kind.value in ("all-reduce", "reduce-scatter")
    )
    if predicted or hlo.bytes("all-reduce"):
        assert hlo.bytes("all-reduce") == pytest.approx(predicted, rel=0.1)
    # all-gather bytes agree too, except where XLA gathers differently from the plan: on 2x2
    # meshes it re-gathers some resharded tensors ("involuntary full rematerialization" in its
    # log), and MoE's token exchange is lowered to its own all-gather/all-to-all mix
    if mesh != (2, 2) and name != "moe":
        gathered = sum(c.nbytes for c in plan.stages[0].collectives
                       if c.kind.value == "all-gather")
        assert hlo.bytes("all-gather") == pytest.approx(gathered, rel=0.1)
