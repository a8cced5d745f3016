"""The marks a traced backward carries for the pipeline runtime to hold it to the plan: they
leave the flat program as it was, record where each cotangent and each contraction's
transposes are, and the contraction's own backward computes what JAX's does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from autopar.ir.cotangent_marks import (
    CT,
    GRAD,
    OTHER,
    SUM,
    Sink,
    dot_with_held_backward,
    mark_cotangent,
    traced_bind,
)
from autopar.ir.flatten import flatten_step
from autopar.ir.program import bind_eqn

W = jax.ShapeDtypeStruct((3, 4, 5), jnp.float32)
X = jax.ShapeDtypeStruct((3, 2, 4), jnp.float32)


def _contraction():
    """A batched contraction (batch dim 0, contracting 2 with 1) as a flat equation."""
    program = flatten_step(lambda w, x: jnp.einsum("bik,bkj->bij", x, w), (W, X))
    (eqn,) = [e for e in program.eqns if e.name == "dot_general"]
    return eqn


def _step(bind, on_value):
    eqn = _contraction()

    def loss(w, x):
        (y,) = bind(eqn, [x, w])
        y = on_value(7, y)  # as the forward's walk replaces each value it makes
        return jnp.sum(jnp.tanh(y) * y)

    def step(w, x):
        value, pull = jax.vjp(loss, w, x)
        return value, pull(jnp.ones((), jnp.float32))

    return step


def _signature(program):
    return [(e.name, e.inputs, e.outputs) for e in program.eqns]


def test_the_marks_leave_the_traced_program_as_it_was_and_say_where_the_backward_is():
    plain = flatten_step(_step(bind_eqn, lambda v, x: x), (W, X))
    marked = flatten_step(_step(traced_bind, mark_cotangent), (W, X))
    assert _signature(marked) == _signature(plain)
    assert not plain.cotangents
    eqn = _contraction().index
    # the cotangent of value 7, and what each transpose reads and makes
    assert 7 in marked.cotangents
    for k in (0, 1):
        for role in (CT, OTHER, GRAD):
            assert (eqn, k, role) in marked.cotangents
    # the transposes read the result's cotangent as it was marked
    assert marked.cotangents[(eqn, 0, CT)] == marked.cotangents[(eqn, 1, CT)] \
        == marked.cotangents[7]
    producers = {v: e for e in marked.eqns for v in e.outputs}
    for k in (0, 1):  # each gradient is a contraction's (through a transpose)
        made = producers[marked.cotangents[(eqn, k, GRAD)]]
        while made.name == "transpose":
            made = producers[made.inputs[0]]
        assert made.name == "dot_general"
        assert marked.cotangents[(eqn, k, CT)] in made.inputs


def test_a_contraction_with_held_backward_differentiates_as_jax_does():
    eqn = _contraction()
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal(W.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal(X.shape), jnp.float32)
    seen = []

    def hold(key, value):
        seen.append(key)
        return value

    def held(w, x):
        return jnp.sum(jnp.sin(dot_with_held_backward(eqn, [x, w], bind_eqn, hold)[0]))

    def plain(w, x):
        return jnp.sum(jnp.sin(bind_eqn(eqn, [x, w])[0]))

    got = jax.grad(held, argnums=(0, 1))(w, x)
    want = jax.grad(plain, argnums=(0, 1))(w, x)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert {(eqn.index, k, role) for k in (0, 1) for role in (CT, OTHER, GRAD)} <= set(seen)
    # an operand not differentiated gets no transpose
    seen.clear()
    jax.grad(held, argnums=0)(w, x)
    assert (eqn.index, 0, GRAD) not in seen and (eqn.index, 1, GRAD) in seen


def test_a_sink_takes_an_operands_gradient_as_its_groups_partial_sums():
    """The transpose making ``w``'s gradient sums over ``x``'s dimensions 0 and 1 (6 x 8);
    with a sink grouping them into 2 x 4 blocks, ``w`` gets no gradient and the sink gets one
    partial sum per block (``[2, 4, *w.shape]``), whose sum is JAX's gradient of ``w``; ``x``'s
    gradient is JAX's. Both operand orders: ``w`` the right operand, then the left."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((6, 8, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    for k, fn, operands in ((1, lambda x, w: jnp.einsum("abk,kj->abj", x, w), (x, w)),
                            (0, lambda w, x: jnp.einsum("kj,abk->jab", w, x), (w, x))):
        program = flatten_step(fn, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                         for a in operands))
        (eqn,) = [e for e in program.eqns if e.name == "dot_general"]
        # the result dimensions ``w``'s transpose contracts: x's 6 and 8, in the result
        groups = ((0, 2), (1, 4)) if k == 1 else ((1, 2), (2, 4))
        held = []

        def hold(key, value, held=held):
            held.append(key)
            return value

        def with_sink(w, x, z, k=k, eqn=eqn, groups=groups):
            ops = [x, w] if k == 1 else [w, x]
            (y,) = dot_with_held_backward(eqn, ops, bind_eqn, hold, {k: Sink(z, groups)})
            return jnp.sum(jnp.sin(y))

        def plain(w, x, k=k, eqn=eqn):
            return jnp.sum(jnp.sin(bind_eqn(eqn, [x, w] if k == 1 else [w, x])[0]))

        sink = jnp.zeros((2, 4, *w.shape), w.dtype)
        gw, gx, partials = jax.grad(with_sink, argnums=(0, 1, 2))(w, x, sink)
        want_w, want_x = jax.grad(plain, argnums=(0, 1))(w, x)
        assert not np.any(gw) and partials.shape == (2, 4, 4, 5)
        np.testing.assert_allclose(partials.sum(axis=(0, 1)), want_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gx, want_x, rtol=1e-6)
        # block (1, 2) is the transpose of x's rows 3..5 and columns 4..5 alone
        cut = x[3:6, 4:6]
        ct = jnp.cos(jnp.einsum("abk,kj->abj", cut, w))
        np.testing.assert_allclose(partials[1, 2], jnp.einsum("abk,abj->kj", cut, ct),
                                   rtol=1e-5, atol=1e-6)
        assert (eqn.index, k, SUM) in held
