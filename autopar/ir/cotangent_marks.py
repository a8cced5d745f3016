"""Where a traced backward computes what, for a pipeline stage's runtime to hold it to its plan.

A pipeline stage's plan is solved on its piece's train step (the forward under ``jax.vjp``,
the backward it derives), and its runtime runs the forward's equations and lets ``jax.vjp``
derive the backward again. The forward's results are held to the plan by value id; the
backward's values have no ids of their own, and XLA, left to itself there, lays out the
cotangents and runs the contractions as it likes (measured on the zoo's pipelines: 30% of the
predicted all-reduce bytes never emitted, all-gathers emitted that no plan had).

Two things are marked when the piece's train step is traced for its ILP, each with the
identity equation ``autopar_cotangent[value=key]``, which the flat program's walker does not
keep but records (``FlatProgram.cotangents``: key -> the marked value's id), so the traced
program, and the plan solved on it, are the same as without the marks:

- ``mark_cotangent(x, value)``: the cotangent of forward value ``value``, keyed by it.
- ``dot_with_held_backward``: a contraction's two transposes (each operand's gradient, from
  the result's cotangent and the other operand), their results and operands keyed
  ``(eqn, k, role)``, so the plan's layout of the operands they read can be found.

The runtime runs the same two functions with a ``hold`` that constrains each role to the
plan's layout instead of marking it (``runtime.pipeline_tasks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from autopar.ir.program import bind_eqn

COTANGENT_MARK = "autopar_cotangent"

# one identity primitive in three roles: on a forward value (``mark_cotangent``), on its
# tangent (what differentiating that makes) and on its cotangent (what transposing the tangent
# makes); the walker keeps none of them and records the last (a primitive, not a
# ``jax.custom_vjp``: tracing one per forward value of GPT-39B's pieces took 0.2 s)
VALUE, TANGENT, COTANGENT = "value", "tangent", "cotangent"
cotangent_mark_p = jcore.Primitive(COTANGENT_MARK)
cotangent_mark_p.def_impl(lambda x, *, value, role: x)
cotangent_mark_p.def_abstract_eval(lambda aval, *, value, role: aval)
mlir.register_lowering(cotangent_mark_p, lambda ctx, x, *, value, role: [x])
batching.primitive_batchers[cotangent_mark_p] = lambda args, dims, *, value, role: (
    cotangent_mark_p.bind(*args, value=value, role=role), dims[0])


def _mark_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, value: Any,
              role: str) -> tuple[Any, Any]:
    (x,), (t,) = primals, tangents
    # the primal passes as it is (one equation less to trace per value)
    if type(t) is ad.Zero:
        return x, t
    return x, cotangent_mark_p.bind(t, value=value, role=TANGENT)


def _mark_transpose(ct: Any, x: Any, *, value: Any, role: str) -> list[Any]:
    if type(ct) is ad.Zero:
        return [ct]
    return [cotangent_mark_p.bind(ct, value=value, role=COTANGENT)]


ad.primitive_jvps[cotangent_mark_p] = _mark_jvp
ad.primitive_transposes[cotangent_mark_p] = _mark_transpose


# roles of a contraction ``eqn`` (operands ``0`` and ``1``) that a hold sees, keyed
# ``(eqn, k, role)``: ``IN``, operand ``k`` as the forward reads it; for the transpose making
# operand ``k``'s gradient, what it reads (``CT``: the result's cotangent; ``OTHER``: the other
# operand) and its result (``GRAD``)
IN, CT, OTHER, GRAD = "in", "ct", "other", "grad"
Hold = Callable[[tuple, Any], Any]


def contraction_key(key: tuple[int, int, str]) -> str:
    """``(eqn, k, role)`` as a plan names it: ``"eqn:k:role"``."""
    return ":".join(map(str, key))


def mark(key: Any, x: Any) -> Any:
    """``x``, marked with ``key`` for the walker."""
    return cotangent_mark_p.bind(x, value=key, role=COTANGENT)


def mark_backward(key: tuple, x: Any) -> Any:
    """The hold that traces for the ILP: marks what the backward reads and makes, not the
    forward's operands (the forward's equations are found by matching, ``piece_plan``)."""
    return x if key[2] == IN else mark(key, x)


def mark_cotangent(value: int, x: Any) -> Any:
    """``x`` (forward value ``value``), whose cotangent the backward marks as its own; a
    value that is not a float has none, and is left alone."""
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return x
    return cotangent_mark_p.bind(x, value=value, role=VALUE)


def dot_with_held_backward(eqn: Any, operands: Sequence[Any],
                           bind: Callable[[Any, Sequence[Any]], Sequence[Any]],
                           hold: Hold) -> Sequence[Any]:
    """``eqn`` (a two-operand contraction) applied to ``operands`` by ``bind``, its backward
    the two transposes JAX's own rule makes, each operand's gradient from the result's
    cotangent and the other operand, with ``hold((eqn.index, k, role), x)`` applied to what
    the transpose making operand ``k``'s gradient reads (``CT``, ``OTHER``) and to that
    gradient (``GRAD``), and to each operand as the forward reads it (``IN``). An operand the
    backward does not differentiate gets no transpose."""
    index = eqn.index

    def run(a: Any, b: Any) -> Any:
        return bind(eqn, [hold((index, 0, IN), a), hold((index, 1, IN), b)])[0]

    @jax.custom_vjp
    def contract(a: Any, b: Any) -> Any:
        return run(a, b)

    def forward(a: Any, b: Any) -> tuple[Any, tuple]:
        # the operands themselves are the residuals: a parameter stays the caller's array
        # (``runtime.vjp_residuals``)
        return run(a.value, b.value), (a.value, b.value, a.perturbed, b.perturbed)

    def backward(res: tuple, ct: Any) -> tuple[Any, Any]:
        a, b, need_a, need_b = res
        if isinstance(ct, jax.custom_derivatives.SymbolicZero):
            return None, None
        grads: list[Any] = [None, None]
        operands = ((need_a, a, b), (need_b, b, a))
        for k in (1, 0):  # JAX transposes the contraction's tangent terms in this order
            needed, mine, other = operands[k]
            if not needed:
                continue
            held = hold((index, k, OTHER), other)

            def linear(x: Any, held: Any = held, k: int = k) -> Any:
                return bind(eqn, [x, held] if k == 0 else [held, x])[0]

            (grad,) = jax.linear_transpose(linear, jax.ShapeDtypeStruct(
                mine.shape, mine.dtype))(hold((index, k, CT), ct))
            grads[k] = hold((index, k, GRAD), grad)
        return grads[0], grads[1]

    contract.defvjp(forward, backward, symbolic_zeros=True)
    return [contract(*operands)]


def held_contraction(eqn: Any, operands: Sequence[Any]) -> bool:
    """Whether ``eqn`` is a contraction whose backward ``dot_with_held_backward`` runs: a
    ``dot_general`` of two float operands."""
    return eqn.name == "dot_general" and len(operands) == 2 and all(
        hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
        for x in operands)


def traced_bind(eqn: Any, operands: Sequence[Any]) -> Sequence[Any]:
    """``eqn`` bound for the ILP's trace: a contraction with its transposes marked."""
    if held_contraction(eqn, operands):
        return dot_with_held_backward(eqn, operands, bind_eqn, mark_backward)
    return bind_eqn(eqn, operands)
