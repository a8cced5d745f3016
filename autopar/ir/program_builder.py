"""Rebuilding a flat program equation by equation: copies of its equations, new values
numbered after its own, and the few single equations a rewrite adds (a leading-axis slice, a
concatenation, a reshape, a copy), each traced once with ``jax.make_jaxpr`` so that it is the
equation JAX itself would emit. The layer-scan split (``scan_split``) rewrites the loss forward
and the step around it with these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import jax

from autopar.ir.program import FlatEqn, FlatProgram, TensorKind


class ProgramBuilder:
    """A program's equations rebuilt in order, with new values numbered after the old."""

    def __init__(self, program: FlatProgram) -> None:
        self.program = program
        self.eqns: list[FlatEqn] = []
        self.avals = dict(program.avals)
        self.kinds = dict(program.kinds)
        self.values = dict(program.values)
        self.next_id = max(program.avals, default=-1) + 1

    def value(self, aval: Any, kind: str = TensorKind.INTERMEDIATE, constant: Any = None) -> int:
        vid = self.next_id
        self.next_id += 1
        self.avals[vid] = aval
        self.kinds[vid] = kind
        if kind in (TensorKind.CONST, TensorKind.LITERAL):
            self.values[vid] = constant
        return vid

    def copy(self, eqn: FlatEqn, **changes: Any) -> int:
        index = len(self.eqns)
        self.eqns.append(replace(eqn, index=index, **changes))
        return index

    def emit(self, primitive: Any, params: dict[str, Any], inputs: Sequence[int],
             outputs: Sequence[int]) -> int:
        index = len(self.eqns)
        self.eqns.append(FlatEqn(index, primitive, dict(params), tuple(inputs), tuple(outputs)))
        return index

    def slice(self, vid: int, i: int) -> tuple[int, int]:
        """Emit ``vid[i:i + 1]``; returns (equation index, slice id)."""
        aval = self.avals[vid]
        out = self.value(slice_aval(aval))
        prim, params = one_eqn(lambda x: jax.lax.slice_in_dim(x, i, i + 1), aval)
        return self.emit(prim, params, [vid], [out]), out

    def concat(self, parts: Sequence[int], out: int) -> int:
        """Emit ``out = concatenate(parts, axis 0)``."""
        prim, params = one_eqn(lambda *xs: jax.lax.concatenate(xs, 0),
                                *[self.avals[p] for p in parts])
        return self.emit(prim, params, parts, [out])

    def reshape(self, vid: int, out: int) -> int:
        """Emit ``out = reshape(vid)`` to ``out``'s shape (a slice squeezed, or stacked)."""
        shape = tuple(self.avals[out].shape)
        prim, params = one_eqn(lambda x: jax.lax.reshape(x, shape), self.avals[vid])
        return self.emit(prim, params, [vid], [out])

    def same(self, vid: int, out: int) -> int:
        """Emit ``out = copy(vid)``: a result under an id of its own."""
        prim, params = one_eqn(lambda x: jax.numpy.array(x, copy=True), self.avals[vid])
        return self.emit(prim, params, [vid], [out])

    def program_with(self, in_ids: Sequence[int], in_paths: Sequence[str]) -> FlatProgram:
        p = self.program
        return FlatProgram(self.eqns, self.avals, self.kinds, self.values, list(in_ids),
                           list(p.out_ids), list(in_paths), list(p.out_paths), p.in_tree,
                           p.out_tree, [(0, len(in_ids))] if p.in_tree is None
                           else list(p.arg_leaf_ranges))


def slice_aval(aval: Any) -> jax.ShapeDtypeStruct:
    """The aval of one leading-axis slice (``[1, ...]``) of ``aval``."""
    return jax.ShapeDtypeStruct((1, *aval.shape[1:]), aval.dtype)


def one_eqn(fn: Any, *avals: Any) -> tuple[Any, dict[str, Any]]:
    """The primitive and parameters of the single equation ``fn`` traces to."""
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return eqn.primitive, dict(eqn.params)
