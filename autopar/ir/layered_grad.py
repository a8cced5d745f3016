"""The loss function's value and gradient traced layer by layer, each distinct layer once.

``jax.value_and_grad`` of the whole loss forward linearizes and transposes every equation of
every layer (GPT-39B: 4.8 s for 48 identical blocks; under ``jax.checkpoint`` per layer, about
10 s). Here the forward is cut into pieces (the repeated block's boundaries, or the planner's
layer cuts), and structurally identical pieces run as one shared function wrapped in a call
JAX differentiates once: ``jax.jit`` (its linearization, partial evaluation and transpose are
cached per jaxpr) or ``jax.checkpoint`` (the rematerialised form). Every piece still appears in
the traced program: the flattening walk inlines each call, so the program holds the same
operations, numbered per layer, as the whole-forward trace (JAX may add the cotangents of a
value read by several layers in another order).

Pieces are shared only when every equation, its parameters, shapes, wiring, the constants it
reads (by identity) and its literals (by value) agree; a forward with scan regions, or without
a repeated block and no cuts given, is differentiated whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import jax

from autopar.ir.loss_markers import LossFunction, expand_value_and_grad
from autopar.ir.pieces import Piece, PieceSlicer, cut_pieces
from autopar.ir.program import FlatProgram, TensorKind, run_eqns
from autopar.ir.repeats import find_repeats
from autopar.ir.walk import flatten_jaxpr

# What a shared piece's function is wrapped in: ``jax.jit`` (plain) or ``jax.checkpoint``.
PieceCall = Callable[[Callable], Callable]


def loss_forward(loss: LossFunction) -> FlatProgram:
    """The loss function's forward as a flat program: closed-over values, then arguments."""
    paths = [f"loss/const{i}" for i in range(loss.num_consts)] + [
        f"loss/arg{i}" for i in range(loss.num_args)
    ]
    return flatten_jaxpr(loss.jaxpr, paths, keep_markers=True)


def block_cuts(forward: FlatProgram) -> list[int] | None:
    """The repeated block's boundaries inside ``forward`` (None: it repeats no block, or runs
    scan regions, which the cut would split)."""
    if forward.regions:
        return None
    grid = find_repeats(forward)
    if grid is None:
        return None
    n = len(forward.eqns)
    return [c for c in range(grid.start, grid.end + 1, grid.period) if 0 < c < n]


def piece_key(forward: FlatProgram, piece: Piece, inputs: Sequence[int]) -> tuple:
    """Equal for two pieces exactly when one's function computes the other's outputs from
    its ``inputs`` in the same order: equations (primitive, parameters), shapes, wiring,
    constants by value id, literals by value."""
    local: dict[int, int] = {}

    def name(v: int) -> tuple:
        aval = forward.avals[v]
        if v not in local and v in forward.values:
            if forward.kinds[v] == TensorKind.LITERAL:
                return ("literal", repr(forward.values[v]), aval.shape, aval.dtype)
            return ("const", v)
        local.setdefault(v, len(local))
        return (local[v], aval.shape, aval.dtype)

    parts: list[Any] = [tuple(name(v) for v in inputs)]
    for i in piece.eqns:
        e = forward.eqns[i]
        parts.append((e.name, _params_key(e.params), tuple(name(v) for v in e.inputs),
                      tuple(name(v) for v in e.outputs)))
    parts.append(tuple(name(v) for v in piece.outputs))
    return tuple(parts)


def _params_key(params: dict[str, Any]) -> tuple:
    """An equation's parameters as a comparable key: hashable ones as they are (most are
    ints, dtypes, tuples), the rest (jaxprs, lists) by their text."""
    key = []
    for k in sorted(params):
        p = params[k]
        try:
            hash(p)
        except TypeError:
            p = repr(p)
        key.append((k, p))
    return tuple(key)


def piece_function(forward: FlatProgram, piece: Piece, inputs: Sequence[int]) -> Callable:
    """``piece`` as a function from its ``inputs``' values (a list) to its outputs' values."""

    def run(values: list[Any]) -> list[Any]:
        env = dict(zip(inputs, values, strict=True))
        run_eqns(forward, piece.eqns, env)
        return [env[v] for v in piece.outputs]

    return run


def _pieces_function(forward: FlatProgram, piece: Piece, inputs: Sequence[int],
                     units: Sequence[Piece], shared: dict[tuple, Callable]) -> Callable:
    """``piece`` as a function like ``piece_function``'s that runs its ``units`` (pieces of
    it, in order) each as the ``jax.jit`` function it shares with its identical units."""

    def run(values: list[Any]) -> list[Any]:
        env = dict(zip(inputs, values, strict=True))
        run_shared(forward, units, env, shared, jax.jit)
        return [env[v] for v in piece.outputs]

    return run


def run_shared(forward: FlatProgram, pieces: Sequence[Piece], env: dict[int, Any],
               shared: dict[tuple, Callable], call: PieceCall,
               units: Callable[[Piece], Sequence[Piece]] | None = None) -> None:
    """Run ``pieces`` in order on ``env`` (value id -> value), each through ``call`` of the
    function it shares with its identical pieces (``shared``, filled here). ``units``: a
    piece's blocks, where a piece holds several: its function runs each block as a shared
    ``jax.jit`` call, so that JAX differentiates each distinct block once even where the
    pieces (a rematerialised step's layers, cut where the clustering balanced them) differ."""
    for piece in pieces:
        inputs = [v for v in piece.inputs if v in env]
        key = (call, piece_key(forward, piece, inputs))
        if key not in shared:
            inner = units(piece) if units is not None else ()
            shared[key] = call(_pieces_function(forward, piece, inputs, inner, shared)
                               if len(inner) > 1 else piece_function(forward, piece, inputs))
        env.update(zip(piece.outputs, shared[key]([env[v] for v in inputs]), strict=True))


def layered_value_and_grad(loss: LossFunction, positions: Sequence[int] | None = None,
                           call: PieceCall = jax.jit) -> Callable[..., list[Any]] | None:
    """[loss, *aux, *grads] like ``loss.value_and_grad``, the forward cut before the
    equations at ``positions`` of ``loss_forward(loss)`` (default: at its repeated block's
    boundaries) and each piece run through ``call`` of the function it shares with its
    identical pieces; with ``positions`` given, a piece holding several repeated blocks runs
    them as shared ``jax.jit`` calls inside. None where the default finds no block to cut
    at."""
    forward = loss_forward(loss)
    blocks = block_cuts(forward)
    cuts = list(positions) if positions is not None else blocks
    if cuts is None:
        return None
    pieces = cut_pieces(forward, cuts)
    shared: dict[tuple, Callable] = {}
    units = None
    if positions is not None and blocks:
        slicer = PieceSlicer(forward)

        def units(piece: Piece) -> list[Piece]:
            a, b = piece.eqns[0], piece.eqns[-1] + 1
            bounds = [a, *(c for c in blocks if a < c < b), b]
            return [slicer.piece(x, y, k) for k, (x, y) in enumerate(pairwise(bounds))]

    def run_forward(values: list[Any]) -> list[Any]:
        env = dict(zip(forward.in_ids, values, strict=True))
        run_shared(forward, pieces, env, shared, call, units)
        return [env[v] if v in env else forward.values[v] for v in forward.out_ids]

    return value_and_grad_of(loss, run_forward)


def value_and_grad_of(loss: LossFunction, run_forward: Callable[[list[Any]], list[Any]]
                      ) -> Callable[..., list[Any]]:
    """[loss, *aux, *grads] of ``loss`` with its forward computed by ``run_forward`` (the
    loss forward's input values -> its output values; the loss first)."""
    def value_and_grad(*operands: Any) -> list[Any]:
        values = list(operands)
        first = loss.num_consts

        def objective(diff_values: list[Any]) -> tuple[Any, list[Any]]:
            full = list(values)
            for i, v in zip(loss.diff_leaves, diff_values, strict=True):
                full[first + i] = v
            out = run_forward(full)
            return out[0], out[1:]

        (value, aux), grads = jax.value_and_grad(objective, has_aux=True)(
            [values[first + i] for i in loss.diff_leaves]
        )
        return [value, *aux, *grads]

    return value_and_grad


def plain_expansion(loss: LossFunction) -> Callable[..., list[Any]]:
    """What an ``autopar_value_and_grad`` equation is inlined as by default: its value and
    gradient, differentiated one distinct layer at a time where the loss forward repeats a
    block (the same operations, traced several times faster), else whole."""
    return layered_value_and_grad(loss) or expand_value_and_grad(loss)
