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
from dataclasses import dataclass
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
# a plan's key, not a mark: which dimensions of the result's cotangent the transpose making
# a parameter's gradient contracts split, its partial sums kept per group (``Sink``)
SUM = "sum"
Hold = Callable[[tuple, Any], Any]


@dataclass(frozen=True)
class Sink:
    """Where the transpose making an operand's gradient puts it instead: partial sums, one
    per group of the ``groups`` (result dimension of the contraction's cotangent, number of
    blocks) it contracts, as the cotangent of ``value``, an extra input of shape
    ``[*blocks, *operand.shape]`` that the forward does not read. The caller sums them."""

    value: Any
    groups: tuple[tuple[int, int], ...]


def contraction_key(key: tuple[int, int, str]) -> str:
    """``(eqn, k, role)`` as a plan names it: ``"eqn:k:role"``."""
    return ":".join(map(str, key))


# equations that only relay a value (a parameter's transpose or cast before a contraction):
# its gradient contraction's partial sums pass back through them (``viewed_parameter``)
VIEWS = frozenset({"transpose", "convert_element_type", "reshape", "copy", "copy_p",
                   "squeeze", "expand_dims"})


def viewed_parameter(made: dict[int, Any], value: int, params: Any
                     ) -> tuple[int, tuple[int, ...]] | None:
    """The parameter among ``params`` that ``value`` is, or is a view of through ``VIEWS``
    equations (each reading one value; ``made``: value id -> the equation making it), and
    those equations' indices from it to ``value``; None if it is neither."""
    chain: list[int] = []
    while value not in params:
        eqn = made.get(value)
        if eqn is None or eqn.name not in VIEWS or len(eqn.inputs) != 1:
            return None
        chain.append(eqn.index)
        value = eqn.inputs[0]
    return value, tuple(reversed(chain))


def parse_contraction_key(key: str) -> tuple[int, int, str]:
    """``contraction_key``'s ``(eqn, k, role)`` back from ``"eqn:k:role"``."""
    eqn, k, role = key.split(":")
    return int(eqn), int(k), role


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
                           hold: Hold, sinks: dict[int, Sink] | None = None) -> Sequence[Any]:
    """``eqn`` (a two-operand contraction) applied to ``operands`` by ``bind``, its backward
    the two transposes JAX's own rule makes, each operand's gradient from the result's
    cotangent and the other operand, with ``hold((eqn.index, k, role), x)`` applied to what
    the transpose making operand ``k``'s gradient reads (``CT``, ``OTHER``) and to that
    gradient (``GRAD``), and to each operand as the forward reads it (``IN``). An operand the
    backward does not differentiate gets no transpose. Operand ``k`` in ``sinks`` gets no
    gradient: its transpose's partial sums go to its sink (``Sink``, held as ``(eqn.index,
    k, SUM)``)."""
    index, sinks = eqn.index, sinks or {}
    sunk = sorted(sinks)

    def run(a: Any, b: Any) -> Any:
        return bind(eqn, [hold((index, 0, IN), a), hold((index, 1, IN), b)])[0]

    @jax.custom_vjp
    def contract(a: Any, b: Any, *_sinks: Any) -> Any:
        return run(a, b)

    def forward(a: Any, b: Any, *_sinks: Any) -> tuple[Any, tuple]:
        # the operands themselves are the residuals: a parameter stays the caller's array
        # (``runtime.vjp_residuals``)
        return run(a.value, b.value), (a.value, b.value, a.perturbed, b.perturbed)

    def backward(res: tuple, ct: Any) -> tuple[Any, ...]:
        a, b, need_a, need_b = res
        grads: list[Any] = [None, None] + [None] * len(sunk)
        if isinstance(ct, jax.custom_derivatives.SymbolicZero):
            return tuple(grads)
        operands = ((need_a, a, b), (need_b, b, a))
        for k in (1, 0):  # JAX transposes the contraction's tangent terms in this order
            needed, mine, other = operands[k]
            if not needed and k not in sinks:
                continue
            held, ct_k = hold((index, k, OTHER), other), hold((index, k, CT), ct)
            if k in sinks:
                grads[2 + sunk.index(k)] = hold((index, k, SUM), _partial_sums(
                    eqn, k, bind, ct_k, held, mine, sinks[k].groups))
            else:
                grads[k] = hold((index, k, GRAD), _transpose(eqn, k, bind, ct_k, held, mine))
        return tuple(grads)

    contract.defvjp(forward, backward, symbolic_zeros=True)
    return [contract(*operands, *(sinks[k].value for k in sunk))]


def _transpose(eqn: Any, k: int, bind: Callable[[Any, Sequence[Any]], Sequence[Any]],
               ct: Any, other: Any, mine: Any) -> Any:
    """Operand ``k``'s gradient (shaped like ``mine``) from the result's cotangent ``ct``
    and the ``other`` operand."""

    def linear(x: Any) -> Any:
        return bind(eqn, [x, other] if k == 0 else [other, x])[0]

    (grad,) = jax.linear_transpose(linear, jax.ShapeDtypeStruct(mine.shape, mine.dtype))(ct)
    return grad


def _partial_sums(eqn: Any, k: int, bind: Callable[[Any, Sequence[Any]], Sequence[Any]],
                  ct: Any, other: Any, mine: Any, groups: tuple[tuple[int, int], ...]) -> Any:
    """``_transpose``'s terms summed per group: each grouped result dimension of ``ct`` and
    the ``other`` operand's dimension it came from cut into blocks, the transpose of block
    ``g`` at ``[g, ...]`` (blocks first, in ``groups``' order)."""
    came_from = _other_dims(eqn, k, ct.ndim, other.ndim)

    def blocked(x: Any, cuts: list[tuple[int, int]]) -> Any:
        """``x`` with each dimension ``d`` of ``cuts`` (``(d, blocks)``) cut into
        ``[blocks, d / blocks]``, the block dimensions first in ``cuts``' order."""
        shape, at = list(x.shape), dict[int, int]()
        for j in sorted(range(len(cuts)), key=lambda j: cuts[j][0]):
            d, g = cuts[j]
            at[j] = d + len(at)  # the cuts before it each added a dimension
            shape[at[j]:at[j] + 1] = [g, shape[at[j]] // g]
        return jax.numpy.moveaxis(x.reshape(shape), [at[j] for j in range(len(cuts))],
                                  list(range(len(cuts))))

    cts = blocked(ct, list(groups))
    others = blocked(other, [(came_from[d], g) for d, g in groups])

    def one(c: Any, o: Any) -> Any:
        return _transpose(eqn, k, bind, c, o, jax.ShapeDtypeStruct(
            mine.shape, mine.dtype))

    for _ in groups:
        one = jax.vmap(one)
    return one(cts, others)


def _other_dims(eqn: Any, k: int, ct_ndim: int, other_ndim: int) -> dict[int, int]:
    """For the transpose making operand ``k``'s gradient: each dimension of the result it
    contracts (the other operand's free dimensions, in the result) -> that dimension of the
    other operand."""
    (contract, batch) = eqn.params["dimension_numbers"]
    j = 1 - k
    free = [d for d in range(other_ndim) if d not in contract[j] and d not in batch[j]]
    mine_free = ct_ndim - len(batch[0]) - len(free)
    first = len(batch[0]) + (mine_free if j == 1 else 0)
    return {first + i: d for i, d in enumerate(free)}


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
