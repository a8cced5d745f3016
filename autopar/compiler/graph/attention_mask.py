"""Whether an attention's mask is the causal one, read off the equations that make it.

A mask made from ``iota`` (``jnp.tril``, ``q_pos >= k_pos``, ...) is a function of positions
alone. Each integer tensor of such a mask is an affine function of the element's index
(``sum_a c_a i_a + c``) and each boolean one a half-space of it (``affine >= 0``), or a
constant: that is all the few primitives masks are made of can produce, so the mask is
followed symbolically, without evaluating an ``S x S`` array (at 128K tokens, 16 GiB). Anything
else (a padding mask read from the batch, a window, a reshape) is not causal here, and the
attention is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.compiler.graph.opgraph import OpGraph
from autopar.ir.program import FlatProgram


@dataclass(frozen=True)
class Affine:
    """``sum(coef * index[axis]) + const`` over a tensor's element index."""

    coefs: tuple[tuple[int, int], ...]  # (axis, coefficient), by axis, no zeros
    const: int

    @staticmethod
    def of(coefs: dict[int, int], const: int) -> Affine:
        return Affine(tuple(sorted((a, c) for a, c in coefs.items() if c)), const)

    def plus(self, other: Affine, sign: int = 1) -> Affine:
        coefs = dict(self.coefs)
        for a, c in other.coefs:
            coefs[a] = coefs.get(a, 0) + sign * c
        return Affine.of(coefs, self.const + sign * other.const)

    def times(self, k: int) -> Affine:
        return Affine.of({a: k * c for a, c in self.coefs}, k * self.const)


@dataclass(frozen=True)
class HalfSpace:
    """The boolean ``affine >= 0``."""

    affine: Affine


# A boolean mask: True, False, or a half-space; an integer tensor: an Affine.
Symbol = Affine | HalfSpace | bool


def is_causal(graph: OpGraph, program: FlatProgram, mask: int) -> bool:
    """Whether the boolean tensor ``mask`` (the shape of the scores, keys on its last axis,
    queries on the one before) is True exactly where the key's position is at most the
    query's."""
    ndim = graph.tensors[mask].ndim
    found = _symbol(graph, program, mask, {})
    if not isinstance(found, HalfSpace) or found.affine.const != 0:
        return False
    coefs = dict(found.affine.coefs)
    c = coefs.get(ndim - 2, 0)
    return c > 0 and coefs == {ndim - 2: c, ndim - 1: -c}


def _scalar(program: FlatProgram, tensor: int) -> Any:
    value = program.values.get(tensor)
    if value is None or np.size(value) != 1:
        return None
    return np.asarray(value).reshape(()).item()


def _symbol(graph: OpGraph, program: FlatProgram, tensor: int,
            seen: dict[int, Symbol | None]) -> Symbol | None:
    if tensor in seen:
        return seen[tensor]
    at = graph.producer.get(tensor)
    if at is None:
        value = _scalar(program, tensor)
        found: Symbol | None = None
        if isinstance(value, bool | np.bool_):
            found = bool(value)
        elif isinstance(value, int | np.integer):
            found = Affine.of({}, int(value))
    else:
        node = graph.nodes[at]
        operands = [_symbol(graph, program, t, seen) for t in node.inputs]
        shapes = [graph.tensors[t].shape for t in node.inputs]
        found = None if any(s is None for s in operands) else _apply(
            node.primitive, node.params, operands, shapes)
    seen[tensor] = found
    return found


def _apply(primitive: str, params: Any, ops: list[Any], shapes: list[tuple]) -> Symbol | None:
    if primitive == "iota":
        return Affine.of({params["dimension"]: 1}, 0)
    if primitive == "copy":
        return ops[0]
    if primitive == "convert_element_type":
        return _converted(ops[0], np.dtype(params["new_dtype"]).kind == "b")
    if primitive == "broadcast_in_dim":
        return _moved(ops[0], {a: d for a, d in enumerate(params["broadcast_dimensions"])
                               if shapes[0][a] != 1})
    if primitive == "transpose":
        return _moved(ops[0], {old: new for new, old in enumerate(params["permutation"])})
    if primitive in ("add", "sub") and all(isinstance(o, Affine) for o in ops):
        return ops[0].plus(ops[1], 1 if primitive == "add" else -1)
    if primitive in ("ge", "gt", "le", "lt") and all(isinstance(o, Affine) for o in ops):
        a, b = ops if primitive in ("ge", "gt") else ops[::-1]
        diff = a.plus(b, -1)
        return HalfSpace(diff if primitive in ("ge", "le") else diff.plus(Affine.of({}, 1), -1))
    if primitive == "not" and isinstance(ops[0], HalfSpace):
        return HalfSpace(ops[0].affine.times(-1).plus(Affine.of({}, 1), -1))
    if primitive == "not" and isinstance(ops[0], bool):
        return not ops[0]
    if primitive in ("and", "or"):
        return _logic(primitive, ops[0], ops[1])
    if primitive == "select_n" and len(ops) == 3:
        pred, when_false, when_true = ops
        if isinstance(pred, bool):
            return when_true if pred else when_false
        if when_false is False and when_true is True:
            return pred
        if when_false is True and when_true is False:
            return _apply("not", params, [pred], shapes)
    return None


def _converted(symbol: Any, to_bool: bool) -> Symbol | None:
    """``symbol`` cast to a boolean or a number type (positions are exact in either)."""
    if isinstance(symbol, bool):
        return symbol if to_bool else Affine.of({}, int(symbol))
    return symbol if isinstance(symbol, HalfSpace) == to_bool else None


def _logic(primitive: str, a: Any, b: Any) -> Symbol | None:
    for x, y in ((a, b), (b, a)):
        if isinstance(x, bool):
            if primitive == "and":
                return y if x else False
            return True if x else y
    return a if a == b else None


def _moved(symbol: Any, axes: dict[int, int]) -> Symbol | None:
    """``symbol`` with its index axes renumbered (``axes``: old -> new; an old axis not in
    it is one of size 1, whose index is always 0)."""
    if isinstance(symbol, bool):
        return symbol
    affine = symbol.affine if isinstance(symbol, HalfSpace) else symbol
    moved = Affine.of({axes[a]: c for a, c in affine.coefs if a in axes}, affine.const)
    return HalfSpace(moved) if isinstance(symbol, HalfSpace) else moved
