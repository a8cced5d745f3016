"""The loss function at one microbatch's size (``pipeline_program._microbatch_loss``): the step
is traced only as far as its ``autopar.value_and_grad`` call where the loss closes over no
constant made from the batch's shape, and traced whole, its constants folded, where it does.
Tracing only; nothing runs."""

import jax
import jax.numpy as jnp
import numpy as np

import autopar
from autopar.ir.loss_markers import traced_loss
from autopar.ir.pipeline_program import build_pipeline_program


def _params():
    return {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}


def _batch():
    return jax.ShapeDtypeStruct((16, 8), jnp.float32)


def _counted_step(after, closed_count: bool):
    """A step whose code after its loss call appends to ``after`` each time it is traced;
    ``closed_count``: its loss closes over the batch's size, made outside it."""

    def step(params, x):
        count = jnp.full((), x.shape[0], jnp.float32)

        def loss_fn(p, x):
            total = jnp.sum(jnp.tanh(x @ p["w"]))
            return total / count if closed_count else jnp.mean(jnp.tanh(x @ p["w"]))

        loss, grads = autopar.value_and_grad(loss_fn)(params, x)
        after.append(1)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return step


def test_the_microbatch_loss_is_traced_without_the_rest_of_the_step():
    after: list[int] = []
    step = _counted_step(after, closed_count=False)
    pp = build_pipeline_program(step, (_params(), _batch()), (1,), 4)
    assert len(after) == 1  # the whole batch's trace only
    # the forward runs at the microbatch's size: 16 / 4 rows
    assert [tuple(pp.forward.avals[v].shape) for v in pp.split_inputs] == [(4, 8)]
    captured = traced_loss(step, (_params(), jax.ShapeDtypeStruct((4, 8), jnp.float32)))
    assert captured is not None and captured.consts == ()
    assert len(after) == 1  # nor here


def test_a_constant_from_the_batch_shape_traces_the_whole_microbatch_step():
    after: list[int] = []
    step = _counted_step(after, closed_count=True)
    pp = build_pipeline_program(step, (_params(), _batch()), (1,), 4)
    assert len(after) == 2  # the whole batch's trace and the microbatch's
    vg = pp.outer.eqns[pp.vg_index]
    consts = [pp.outer.values.get(v) for v in vg.inputs[:pp.loss.num_consts]]
    assert [float(np.asarray(c)) for c in consts] == [4.0]  # the microbatch's count
