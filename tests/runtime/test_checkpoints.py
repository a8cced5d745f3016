"""Checkpoints that move between plans: a state saved with Orbax under one plan, restored with
``autopar.restore_target`` under another plan, mesh or device count, and trained on.

The tiny MLP (2 layers, Adam; 512 wide, so that ShardParallel splits its weights) runs 3
steps from seed 0 on the serial reference's batches: one under the plan that saves, two under
the plan that restores. Each case checks that the restored state is the saved one bit for bit,
on the restoring step's devices in its layout; that training on from it is the run that handed
the state over in memory and never stopped (bitwise where the restoring step is one program
with fixed input shardings); and that its losses and final state are the serial single-device
``jax.jit`` run's within fp32's tolerance (the plans sum in other orders).
"""

import functools

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from serial_reference import serial_run

import autopar
from autopar.models import get_model

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3  # one under the saving plan, the rest under the restoring one


@functools.cache
def zoo():
    model = get_model("mlp", "tiny", num_layers=2, hidden_size=512)
    return model.with_value_and_grad(autopar.value_and_grad)


def batch(i):
    return zoo().make_batch(jax.random.key(10 + i))


@functools.cache
def saving_step(name):
    """The plan a state is saved under: ShardParallel 2x4 on the 8 devices, or a 2-stage
    pipeline (4 devices a stage, 2 microbatches); its state after the first step."""
    if name == "shard-2x4":
        method = autopar.ShardParallel(mesh_shape=(2, 4))
    else:
        method = autopar.PipeshardParallel(num_microbatches=2, stages="uniform", num_stages=2,
                                           layers=2)
    step = autopar.parallelize(zoo().train_step, method=method)
    state, loss = step(zoo().init_state(jax.random.key(0)), batch(0))
    return step, state, float(loss)


@functools.cache
def restoring_step(name):
    """The plan a state is restored under: DataParallel on 2 of the 8 devices, or a one-stage
    pipeline (the same 2 microbatches) on the last 4; or ZeRO-3 on 4 devices across both."""
    devices = jax.devices()
    if name == "zero3-4dev":
        return autopar.parallelize(zoo().train_step, method=autopar.Zero3Parallel(),
                                   devices=devices[2:6])
    if name == "data-2dev":
        return autopar.parallelize(zoo().train_step, method=autopar.DataParallel(),
                                   devices=devices[:2])
    method = autopar.PipeshardParallel(num_microbatches=2, stages="uniform", num_stages=1,
                                       layers=1)
    return autopar.parallelize(zoo().train_step, method=method, devices=devices[4:])


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def paths(tree):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def train_on(step, state):
    """Steps 1 .. STEPS-1 from ``state``: (losses, final state)."""
    losses = []
    for i in range(1, STEPS):
        state, loss = step(state, batch(i))
        losses.append(float(loss))
    return losses, state


def save_and_restore(directory, state, step):
    """``state`` saved with Orbax and restored into ``step``'s layout."""
    abstract = jax.eval_shape(zoo().init_state, jax.random.key(0))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "state", state)
        checkpointer.wait_until_finished()
        return checkpointer.restore(directory / "state",
                                    autopar.restore_target(step, abstract, batch(1)))


def assert_matches_serial(losses, state):
    """All STEPS losses and the final state agree with the serial ``jax.jit`` run (fp32)."""
    want_losses, want_leaves = serial_run(zoo(), STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    atol = 2e-3 * zoo().config.learning_rate
    for path, got, want in zip(paths(state), leaves(state), want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol, err_msg=path)


def assert_bitwise(got, want):
    for path, a, b in zip(paths(want), leaves(got), leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)


@pytest.mark.parametrize("saved, restored", [("shard-2x4", "data-2dev"),
                                             ("pipeline-2st", "pipeline-1st")])
def test_checkpoint_moves_between_plans(tmp_path, saved, restored):
    _, state, first_loss = saving_step(saved)
    # saved from all 8 devices: the 2x4 mesh splits some leaves, the stages hold 4 each
    assert {d for leaf in leaves(state) for d in leaf.sharding.device_set} == set(jax.devices())
    if saved == "shard-2x4":
        assert not all(leaf.sharding.is_fully_replicated for leaf in leaves(state))
    else:
        assert len({frozenset(leaf.sharding.device_set) for leaf in leaves(state)}) >= 2
    step = restoring_step(restored)
    back = save_and_restore(tmp_path, state, step)

    assert_bitwise(back, state)
    wanted = step.input_shardings(back, batch(1))[: len(leaves(back))]  # the state's leaves
    for path, leaf, sharding in zip(paths(back), leaves(back), wanted, strict=True):
        # on the restoring step's devices, in its plan's layout
        assert leaf.sharding == sharding, path
        assert leaf.sharding.device_set == set(step.devices), path
        assert restored != "data-2dev" or leaf.sharding.is_fully_replicated, path

    losses, final = train_on(step, back)
    handed_losses, handed = train_on(step, state)  # the saving plan's arrays, in memory
    if restored == "data-2dev":
        # one program with fixed input shardings: the arrays placed, the same arithmetic
        assert losses == handed_losses
        assert_bitwise(final, handed)
    else:
        # a one-stage pipeline is one jitted program compiled for its inputs' layouts, and
        # the handed state's are the 2-stage plan's: the same sums, maybe another order
        np.testing.assert_allclose(losses, handed_losses, rtol=1e-6)
        for path, a, b in zip(paths(final), leaves(final), leaves(handed), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9,
                                       err_msg=path)
    assert_matches_serial([first_loss, *losses], final)


@pytest.mark.parametrize("name", ["data-2dev", "pipeline-2st", "pipeline-1st"])
def test_restore_mid_run_is_bitwise_the_run_that_never_stopped(tmp_path, name):
    """Under one plan: checkpointed after the first step, restored, the next steps give bit
    for bit what the uninterrupted run does."""
    step = saving_step(name)[0] if name == "pipeline-2st" else restoring_step(name)
    state, loss = step(zoo().init_state(jax.random.key(0)), batch(0))
    back = save_and_restore(tmp_path, state, step)
    losses, final = train_on(step, back)
    never_stopped_losses, never_stopped = train_on(step, state)
    assert losses == never_stopped_losses
    assert_bitwise(final, never_stopped)
    assert_matches_serial([float(loss), *losses], final)


@pytest.mark.parametrize("source", ["shard-2x4", "pipeline-2st", "data-2dev", "zero3-4dev"])
def test_any_plans_state_is_accepted_by_every_step(source):
    """A state laid out by one plan (its mesh, its devices) is a valid input of every other
    plan's step, which gives what it gives on its own layout of the same values."""
    if source in ("data-2dev", "zero3-4dev"):
        state, _ = restoring_step(source)(zoo().init_state(jax.random.key(0)), batch(0))
    else:
        state = saving_step(source)[1]
    host = jax.tree_util.tree_map(np.asarray, state)
    targets = [saving_step("shard-2x4")[0], saving_step("pipeline-2st")[0],
               restoring_step("data-2dev"), restoring_step("pipeline-1st"),
               restoring_step("zero3-4dev")]
    for step in targets:
        got_state, got_loss = step(state, batch(1))
        want_state, want_loss = step(host, batch(1))  # the same values from the host
        on = {d for leaf in leaves(got_state) for d in leaf.sharding.device_set}
        assert on <= set(step.devices or jax.devices())  # moved onto the step's own devices
        assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
        for path, a, b in zip(paths(want_state), leaves(got_state), leaves(want_state),
                              strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8,
                                       err_msg=path)


def test_restore_target_names_a_bad_argument():
    step = autopar.parallelize(zoo().train_step, method=autopar.DataParallel(),
                               static_argnums=(2,))
    abstract = jax.eval_shape(zoo().init_state, jax.random.key(0))
    with pytest.raises(autopar.InvalidOptionError, match="argnum=3"):
        autopar.restore_target(step, abstract, batch(0), "flag", argnum=3)
    with pytest.raises(autopar.InvalidOptionError, match="static"):
        autopar.restore_target(step, abstract, batch(0), "flag", argnum=2)
