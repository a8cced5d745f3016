"""Steps whose layers run under ``jax.lax.scan`` give the serial ``jax.jit`` step's numbers
under every one-stage method: the scanned zoo GPT (data, shard, ZeRO-2/3, the default search),
Flax ``nn.scan`` (with and without ``nn.remat`` around the block) and ``nnx.scan`` models
(shard, default), and a step of nested and unusual scans (shard, data). Loss of every step and
every updated state leaf after 3 Adam steps, fp32, at test_shard_numerics.py's tolerances.

For the sharded GPT the plan's predicted all-reduce bytes are also compared with the compiled
program's, counting what the while loops hold once per iteration.

The default search runs with ``measure_candidates=0`` (``SEARCH``): its own choice, not the
fastest of three candidates compiled and timed first (tests/runtime/test_measured_choice.py's
subject), which took most of those cases' time."""

import functools

import jax
import numpy as np
import pytest
from flax_models import scan_lm_setup
from hlo_loops import split_by_loop
from scan_steps import odd_train_step
from serial_reference import serial_run
from step_runs import assert_same_run, run_steps

import autopar
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3
LAYERS = 2
PARAM_ATOL_IN_LR = 2e-3  # as test_shard_numerics.py's for GPT (see ZooModel.optimizer)
SHARD = autopar.ShardParallel(mesh_shape=(4, 2))  # 2x4 proves optimal in ~15 s here; 4x2 in ~4
SEARCH = autopar.AutoParallel(measure_candidates=0)  # the default search, nothing timed


def scanned_gpt():
    return get_model("gpt", "tiny", num_layers=LAYERS, scan_layers=True)


@functools.cache
def gpt_reference():
    return serial_run(scanned_gpt(), STEPS)


@functools.cache
def flax_reference(kind):
    """The plain ``jax.jit`` run of ``scan_lm_setup(kind)`` (a fixed seed: the same for every
    method compared with it), computed once per kind and process."""
    train_step, state, batch = scan_lm_setup(kind)
    return run_steps(jax.jit(train_step), state, batch)


def devices_for(method):
    shape = getattr(method, "mesh_shape", None)
    return jax.devices()[:int(np.prod(shape))] if shape else None


@pytest.mark.parametrize("method", [
    autopar.DataParallel(), SHARD, autopar.Zero2Parallel(), autopar.Zero3Parallel(), SEARCH,
], ids=["data", "shard", "zero2", "zero3", "default"])
def test_scanned_gpt_matches_the_serial_step(method):
    model = scanned_gpt()
    step = autopar.parallelize(model.train_step, method=method, cache=False,
                               devices=devices_for(method))
    want_losses, want_leaves = gpt_reference()
    state = model.init_state(jax.random.key(0))
    for i in range(STEPS):
        batch = model.make_batch(jax.random.key(10 + i))
        state, loss = step(state, batch)
        assert float(loss) == pytest.approx(want_losses[i], rel=1e-5, abs=1e-6)
    atol = PARAM_ATOL_IN_LR * model.config.learning_rate
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    for path, want, got in zip(paths, want_leaves, jax.tree_util.tree_leaves(state),
                               strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol, err_msg=path)
    if method is SHARD:
        plan = step.get_plan(state, batch)
        predicted = sum(c.nbytes for c in plan.stages[0].collectives
                        if c.kind.value in ("all-reduce", "reduce-scatter"))
        inside, outside = split_by_loop(step.get_hlo_text(state, batch))
        emitted = outside.bytes("all-reduce") + LAYERS * inside.bytes("all-reduce")
        assert inside.total_count > 0  # the plan communicates inside the loop body
        assert emitted == pytest.approx(predicted, rel=0.1)


@pytest.mark.parametrize("kind, method", [
    ("linen", SHARD), ("linen", SEARCH), ("linen-remat", SHARD), ("nnx", SHARD), ("nnx", SEARCH),
], ids=["linen-shard", "linen-default", "linen-remat-shard", "nnx-shard", "nnx-default"])
def test_flax_scanned_layers_match_jit(kind, method):
    train_step, state, batch = scan_lm_setup(kind)
    want = flax_reference(kind)
    step = autopar.parallelize(train_step, method=method, cache=False,
                               devices=devices_for(method))
    assert_same_run(run_steps(step, state, batch), want)
    plan = step.get_plan(state, batch)
    assert plan.method.value in ("shard", "data", "zero2", "zero3")


@pytest.mark.parametrize("method", [autopar.ShardParallel(mesh_shape=(2, 4)),
                                    autopar.DataParallel()], ids=["shard", "data"])
def test_nested_and_unusual_scans_match_jit(method):
    train_step, state, batch = odd_train_step()
    want = run_steps(jax.jit(train_step), state, batch)
    step = autopar.parallelize(train_step, method=method, cache=False)
    assert_same_run(run_steps(step, state, batch), want)
