"""Every parallel method with plain SGD and SGD with momentum: the serial step's numbers.

The zoo models train with Adam, whose update ``lr * m / (sqrt(v) + eps)`` sees a gradient off
by a constant factor (summed over devices or microbatches instead of averaged) only through
``eps``: the tiny zoo models' gradients are small enough beside eps 1e-3 that such a factor
still shows, but a model with larger gradients, or optax's eps 1e-8, would hide it. An SGD
update is ``lr * g``, and its momentum trace carries ``g`` into later steps, so a wrong gradient
scale changes every updated weight, the momentum state, and the loss from the second step on
(a factor of 1.01 on the parallel side fails these comparisons).

Each case runs 3 steps of ``tests/tanh_mlp.py``'s step (dense tanh layers, mean-squared error,
differentiated with ``autopar.value_and_grad`` so the pipeline can cut it) and compares the loss
of every step and every updated state leaf with the plain single-device ``jax.jit`` step (fp32,
rtol 1e-5, atol 1e-6: SGD does not amplify summation-order rounding the way Adam does).
"""

import functools

import jax
import numpy as np
import optax
import pytest
from serial_reference import serial_run
from tanh_mlp import tanh_mlp_step

import autopar

# the end-to-end tier: compiles and runs parallel steps (the fast tier is -m 'not e2e')
pytestmark = pytest.mark.e2e

STEPS = 3
WIDTHS = (32, 64, 64, 16)
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.1, momentum=0.9)}
# name -> (method, batch size)
METHODS = {
    "data-8": (lambda: autopar.DataParallel(mesh_shape=(8,)), 32),
    "data-2x4": (lambda: autopar.DataParallel(mesh_shape=(2, 4)), 32),
    # at 32 rows the ILP splits the weights (Megatron-style, batch whole): partial sums over
    # the split dimension; at 256 it splits the batch: gradients summed over devices
    "shard-2x4": (lambda: autopar.ShardParallel(mesh_shape=(2, 4)), 32),
    "shard-2x4-b256": (lambda: autopar.ShardParallel(mesh_shape=(2, 4)), 256),
    "zero2-8": (lambda: autopar.Zero2Parallel(mesh_shape=(8,)), 32),
    "zero3-2x4": (lambda: autopar.Zero3Parallel(mesh_shape=(2, 4)), 32),
    # 4 microbatches of 8: a gradient summed over them instead of averaged is 4x too large
    "pipeshard-1f1b": (lambda: autopar.PipeshardParallel(
        num_microbatches=4, schedule="1f1b", stages="uniform", num_stages=2, layers=2), 32),
    # the backward split into input and weight gradients accumulates the weights' separately
    "pipeshard-zb-h1": (lambda: autopar.PipeshardParallel(
        num_microbatches=4, schedule="zb-h1", stages="uniform", num_stages=2, layers=2), 32),
}


class TanhMLP:
    """tests/tanh_mlp.py's step with optimizer ``opt``, with the ``init_state`` /
    ``make_batch`` / ``train_step`` that ``serial_reference.serial_run`` drives."""

    def __init__(self, opt: optax.GradientTransformation, batch_size: int = 32):
        self.opt = opt
        self.batch_size = batch_size
        self.train_step = tanh_mlp_step(opt)

    def init_state(self, key):
        keys = jax.random.split(key, len(WIDTHS) - 1)
        params = [jax.random.normal(k, (a, b)) * a**-0.5
                  for k, a, b in zip(keys, WIDTHS[:-1], WIDTHS[1:], strict=True)]
        return {"params": params, "opt": self.opt.init(params)}

    def make_batch(self, key):
        kx, ky = jax.random.split(key)
        return {"x": jax.random.normal(kx, (self.batch_size, WIDTHS[0])),
                "y": jax.random.normal(ky, (self.batch_size, WIDTHS[-1]))}


@functools.cache
def serial(opt_name, batch_size=32):
    return serial_run(TanhMLP(OPTIMIZERS[opt_name](), batch_size), STEPS)


def run_parallel(model, step):
    state = model.init_state(jax.random.key(0))
    losses = []
    for i in range(STEPS):
        state, loss = step(state, model.make_batch(jax.random.key(10 + i)))
        losses.append(float(loss))
    return losses, state


def assert_matches_serial(losses, state, ref_losses, ref_leaves):
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6, err_msg="losses")
    leaves = jax.tree_util.tree_leaves_with_path(state)
    assert len(leaves) == len(ref_leaves)
    for (path, got), want in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("method_name", list(METHODS))
def test_sgd_equals_serial(method_name, opt_name):
    make_method, batch_size = METHODS[method_name]
    model = TanhMLP(OPTIMIZERS[opt_name](), batch_size)
    step = autopar.parallelize(model.train_step, method=make_method(), cache=False)
    losses, state = run_parallel(model, step)
    ref_losses, ref_leaves = serial(opt_name, batch_size)
    assert_matches_serial(losses, state, ref_losses, ref_leaves)
    plan = step.get_plan(state, model.make_batch(jax.random.key(0)))
    assert plan.method == method_name.split("-")[0]
    assert sorted(d for st in plan.stages for d in st.device_ids) == list(range(8))
    if plan.method == "pipeshard":
        assert len(plan.stages) == 2
    if method_name == "shard-2x4-b256":  # what the case is here for
        assert plan.shardings()["batch/x"] == "P(('x', 'y'), None)", plan.shardings()


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_a_gradient_off_by_a_factor_of_two_fails_the_comparison(opt_name):
    # the smallest device or microbatch count above: a step whose gradient is twice the true
    # one (as a sum over two devices instead of their mean would be) is far outside the
    # tolerance, for the weights and for the losses after the first step
    def doubled(fn):
        def value_and_grad(*args, **kwargs):
            loss, grads = jax.value_and_grad(fn)(*args, **kwargs)
            return loss, jax.tree_util.tree_map(lambda g: 2 * g, grads)
        return value_and_grad

    model = TanhMLP(OPTIMIZERS[opt_name]())
    model.train_step = tanh_mlp_step(model.opt, doubled)
    losses, state = run_parallel(model, jax.jit(model.train_step))
    ref_losses, ref_leaves = serial(opt_name)
    assert losses[0] == ref_losses[0]
    with pytest.raises(AssertionError, match="losses"):
        assert_matches_serial(losses, state, ref_losses, ref_leaves)
    for got, want in zip(jax.tree_util.tree_leaves(state), ref_leaves, strict=True):
        assert not np.allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
