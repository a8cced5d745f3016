"""Parameters read as one copy per batch group, so that a microbatch's weight gradients stay
partial sums until the step's one reduction.

Under ``jax.jit`` in auto sharding mode, a parameter replicated over the mesh axes that split
the batch gets its gradient all-reduced where the gradient is made: in every microbatch's
backward. A one-stage pipeline of ``m`` microbatches then reduces its data-parallel gradients
``m`` times per step, where its plan (like Alpa's) prices one reduction per step
(``compiler.inter_op.step_parts.amortise``). JAX's own answer, explicit sharding mode with
``reduced`` parameters and ``unreduced`` gradients, does not run the zoo on jax 0.10.2: it
has no rule for convolutions, refuses an add of a batch-split operand and a reduced one, and
fails inside GPT's forward (docs/pipeline.md).

So the forward reads such a parameter ``p`` as its *copies*: an array ``[G, *p.shape]``
whose first dimension is split over the batch axes ``A`` (``G`` their size): each device
holds the copy of its group, made where it lies (a broadcast, no collective). Every equation
where the copies meet the batch runs per group (``jax.vmap``): the batch-split operand's
dimension cut into ``G`` blocks, block ``g`` computed with copy ``g``, the result's blocks
merged back. Every example still meets an exact copy of ``p``, so the forward's values are
unchanged; but the cotangent of the copies is one partial sum per group, ``[G, ...]`` split
over ``A``, which needs no collective. The pipeline makes each piece's copies once per step
(``PieceTasks.make_copies``; its forwards' residuals leave them out,
``runtime.vjp_residuals``), accumulates the partial sums over the microbatches and sums the
first dimension once after the last (``runtime.gradient_sinks.add_partial_sums``, as the
sinks' are): one reduction per step, as planned,
whether the step is one program (``runtime.fused_step``), task by task, or several stages.

Which equations can run per group, and how (``plan_param_copies``): a dot whose batch-split
operand keeps the split dimension free, a convolution over a batch-split input, a gather of a
parameter at batch-split indices, and a broadcast of a parameter along a batch-split
dimension; every equation that reads only copies (a cast, a transpose) runs on each copy. A
parameter any other equation reads, or one whose batch dimension the stage plan does not
split over the same axes at each of its readers, stays as it is (its gradient reduced per
microbatch, as before).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.ir.program import FlatEqn, FlatProgram, bind_eqn
from autopar.ir.scan_split import ELEMENTWISE
from autopar.plan import ShardingSpec
from autopar.runtime.shard import partition_spec

__all__ = ["GroupedEqn", "ParamCopies", "plan_param_copies"]

Axes = tuple[str, ...]


@dataclass(frozen=True)
class GroupedEqn:
    """An equation run per group: the ``operands``' dimension ``dim`` cut into the groups'
    blocks (no operands: a broadcast of copies) and the result's dimension ``out_dim``
    merged from them."""

    operands: tuple[int, ...]
    dim: int
    out_dim: int
    axes: Axes


@dataclass(frozen=True)
class ParamCopies:
    """Which parameters a piece reads as copies, and how its equations run on them."""

    # parameter id -> the batch axes its copies are split over
    params: dict[int, Axes] = field(default_factory=dict)
    # every value held as copies (the parameters and what only they make) -> its axes
    copies: dict[int, Axes] = field(default_factory=dict)
    # equation index -> how it runs per group (the batch meets the copies there)
    grouped: dict[int, GroupedEqn] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def groups(self, axes: Axes) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def sharding(self, mesh: Mesh, vid: int, spec: ShardingSpec | None, ndim: int) -> Any:
        """Copies of value ``vid`` (``ndim`` dimensions each): the first dimension over its
        axes, the rest as the plan lays the value out (unconstrained where it does not)."""
        (head,) = partition_spec(ShardingSpec((self.copies[vid],)))
        rest = ([PartitionSpec.UNCONSTRAINED] * ndim if spec is None
                else list(partition_spec(spec)))
        return NamedSharding(mesh, PartitionSpec(head, *rest))

    def make(self, x: Any, vid: int, mesh: Mesh, spec: ShardingSpec | None) -> Any:
        """Parameter ``vid``'s copies from its value ``x``."""
        g = self.groups(self.copies[vid])
        copies = jnp.broadcast_to(x[None], (g, *x.shape))
        return jax.lax.with_sharding_constraint(copies, self.sharding(mesh, vid, spec, x.ndim))

    def bind(self, eqn: FlatEqn, operands: Sequence[Any]) -> Sequence[Any]:
        """``eqn`` applied to ``operands``, per group where it reads copies."""
        per_copy = [v in self.copies for v in eqn.inputs]
        if not any(per_copy):
            return bind_eqn(eqn, operands)
        in_axes: list[int | None] = [0 if c else None for c in per_copy]
        grouped = self.grouped.get(eqn.index)
        if grouped is None:  # it reads only copies: it runs on each
            return jax.vmap(lambda *ops: list(bind_eqn(eqn, ops)), in_axes=in_axes)(*operands)
        g = self.groups(grouped.axes)
        if not grouped.operands:  # a broadcast along a batch-split dimension
            shape = list(eqn.params["shape"])
            shape[grouped.out_dim] //= g
            dims = eqn.params["broadcast_dimensions"]
            broadcast = jax.vmap(lambda p: jax.lax.broadcast_in_dim(p, shape, dims))(operands[0])
            return [_merge(broadcast, grouped.out_dim)]
        ops, d = list(operands), grouped.dim
        for k in grouped.operands:
            x = ops[k]
            ops[k] = x.reshape(*x.shape[:d], g, x.shape[d] // g, *x.shape[d + 1:])
            in_axes[k] = d
        blocks = jax.vmap(lambda *o: list(bind_eqn(eqn, o)), in_axes=in_axes)(*ops)
        return [_merge(b, grouped.out_dim) for b in blocks]


def _merge(blocks: Any, dim: int) -> Any:
    """``[G, ..., n / G at dim, ...]`` -> ``[..., n at dim, ...]``, block ``g`` at ``g``."""
    moved = jnp.moveaxis(blocks, 0, dim)
    return moved.reshape(*moved.shape[:dim], moved.shape[dim] * moved.shape[dim + 1],
                         *moved.shape[dim + 2:])


@dataclass(frozen=True)
class _Layouts:
    """Where the stage plan splits a value's dimension: its spec's axes, or for a value the
    plan has no spec of (``runtime`` lets XLA choose there), the batch's axes along its
    first dimension."""

    specs: dict[int, ShardingSpec]
    batch_axes: Axes

    def split(self, vid: int, dim: int) -> Axes:
        spec = self.specs.get(vid)
        if spec is None:
            return self.batch_axes if dim == 0 else ()
        return tuple(spec.dims[dim]) if dim < len(spec.dims) else ()


def plan_param_copies(forward: FlatProgram, eqns: Sequence[int], params: Sequence[int],
                      outputs: Sequence[int], specs: dict[int, ShardingSpec],
                      sizes: dict[str, int], batch_axes: Axes) -> ParamCopies:
    """Which of ``params`` the equations ``eqns`` can read as copies, under the stage plan's
    ``specs`` (forward value id -> spec) on a mesh of axis ``sizes`` whose ``batch_axes``
    split the batch's first dimension; ``outputs``: the values the piece gives out (a
    parameter or copies among them stays as it is)."""
    candidates = set(params)
    layouts = _Layouts(specs, tuple(batch_axes))
    while candidates:
        found = _walk(forward, eqns, candidates, set(outputs), layouts, sizes)
        if isinstance(found, ParamCopies):
            return found
        candidates -= found
    return ParamCopies(sizes=dict(sizes))


def _walk(forward: FlatProgram, eqns: Sequence[int], candidates: set[int], outputs: set[int],
          layouts: _Layouts, sizes: dict[str, int]) -> ParamCopies | set[int]:
    """The copies of ``candidates`` if every reader of them runs per group; otherwise the
    candidates to give up (those some reader cannot take)."""
    sources: dict[int, frozenset[int]] = {p: frozenset([p]) for p in candidates}
    axes_of: dict[int, Axes] = {}
    grouped: dict[int, GroupedEqn] = {}
    failed: set[int] = set()

    def agree(srcs: frozenset[int], axes: Axes) -> bool:
        if any(axes_of.get(p, axes) != axes for p in srcs):
            return False
        axes_of.update(dict.fromkeys(srcs, axes))
        return True

    for i in eqns:
        eqn = forward.eqns[i]
        read = [v for v in eqn.inputs if v in sources]
        if not read:
            continue
        srcs = frozenset().union(*(sources[v] for v in read))
        rule = _grouping(forward, eqn, read, layouts, sizes)
        if rule is False or set(eqn.outputs) & outputs:
            failed |= srcs
        elif rule is None:  # reads only copies: its results are copies
            sources.update(dict.fromkeys(eqn.outputs, srcs))
        elif agree(srcs, rule.axes):
            grouped[i] = rule
        else:
            failed |= srcs
    failed |= {p for p in candidates if p in outputs or p not in axes_of}
    for v, srcs in sources.items():  # copies split over axes their value's plan uses too
        spec = layouts.specs.get(v)
        axes = axes_of.get(next(iter(srcs)))
        if spec is not None and axes is not None and set(axes) & {a for d in spec.dims
                                                                  for a in d}:
            failed |= srcs
    if failed:
        return failed
    return ParamCopies(params={p: axes_of[p] for p in candidates},
                       copies={v: axes_of[next(iter(s))] for v, s in sources.items()},
                       grouped=grouped, sizes=dict(sizes))


def _grouping(forward: FlatProgram, eqn: FlatEqn, read: list[int], layouts: _Layouts,
              sizes: dict[str, int]) -> GroupedEqn | None | Literal[False]:
    """How ``eqn``, reading copies ``read``, runs: None when it reads nothing else (on each
    copy), a ``GroupedEqn``, or False when it cannot run per group."""
    others = [k for k, v in enumerate(eqn.inputs)
              if v not in read and forward.kinds.get(v) not in ("literal", "const")]
    name, out = eqn.primitive.name, eqn.outputs[0]
    if not others:
        if name == "broadcast_in_dim" and eqn.params.get("sharding") is None:
            return _broadcast_grouping(forward, eqn, layouts, sizes) or None
        return None
    if len(eqn.outputs) != 1:
        return False
    if name in ELEMENTWISE:  # each block meets its group's copy, of size 1 along the cut
        return _elementwise_grouping(forward, eqn, others, layouts, sizes)
    if len(others) != 1:
        return False
    k = others[0]
    shape = forward.avals[eqn.inputs[k]].shape
    for d, out_dim in _batch_dims(forward, eqn, k):
        axes = layouts.split(out, out_dim)
        if axes and layouts.split(eqn.inputs[k], d) in ((), axes) and shape[d] % math.prod(
                sizes[a] for a in axes) == 0:
            return GroupedEqn((k,), d, out_dim, axes)
    return False


def _elementwise_grouping(forward: FlatProgram, eqn: FlatEqn, others: list[int],
                          layouts: _Layouts, sizes: dict[str, int]) -> GroupedEqn | Literal[False]:
    """An elementwise equation of batch-split operands (``others``) and copies: cut along a
    dimension the plan splits in its result, where every copy has size 1."""
    out = forward.avals[eqn.outputs[0]].shape
    shapes = [forward.avals[v].shape if forward.kinds.get(v) not in ("literal", "const")
              else None for v in eqn.inputs]
    for d, n in enumerate(out):
        axes = layouts.split(eqn.outputs[0], d)
        if not axes or n % math.prod(sizes[a] for a in axes):
            continue
        cut = tuple(k for k in others  # (a batch-split operand: not a literal, so a shape)
                    if (sk := shapes[k]) is not None and len(sk) == len(out) and sk[d] == n)
        rest_fit = all(s is None or len(s) == 0 or (len(s) == len(out) and s[d] == 1)
                       for k, s in enumerate(shapes) if k not in cut)
        if cut and rest_fit and all(layouts.split(eqn.inputs[k], d) in ((), axes)
                                    for k in cut):
            return GroupedEqn(cut, d, d, axes)
    return False


def _batch_dims(forward: FlatProgram, eqn: FlatEqn, k: int) -> list[tuple[int, int]]:
    """(dimension of operand ``k``, result dimension) pairs along which ``eqn``'s result is
    computed independently, block by block, for a primitive that can run per group."""
    name, p = eqn.primitive.name, eqn.params
    ndim = len(forward.avals[eqn.inputs[k]].shape)
    if name == "dot_general" and p.get("out_sharding") is None:
        (contract, batch) = p["dimension_numbers"]
        if batch[0] or batch[1]:
            return []
        free = [d for d in range(ndim) if d not in contract[k]]
        before = 0 if k == 0 else len(forward.avals[eqn.inputs[0]].shape) - len(contract[0])
        return [(d, before + j) for j, d in enumerate(free)]
    if name == "conv_general_dilated" and k == 0 and p["feature_group_count"] == 1 \
            and p["batch_group_count"] == 1:
        numbers = p["dimension_numbers"]
        return [(numbers.lhs_spec[0], numbers.out_spec[0])]
    if name == "gather" and k == 1:
        numbers = p["dimension_numbers"]
        if numbers.operand_batching_dims:
            return []
        out_ndim = len(forward.avals[eqn.outputs[0]].shape)
        places = [d for d in range(out_ndim) if d not in numbers.offset_dims]
        return list(zip(range(ndim - 1), places, strict=False))  # the last: index vector
    return []


def _broadcast_grouping(forward: FlatProgram, eqn: FlatEqn, layouts: _Layouts,
                        sizes: dict[str, int]) -> GroupedEqn | None:
    """A broadcast of copies along a dimension the plan splits: run per group, its result
    is an ordinary value (each block from its group's copy)."""
    shape = eqn.params["shape"]
    operand = forward.avals[eqn.inputs[0]].shape
    mapped = dict(zip(eqn.params["broadcast_dimensions"], operand, strict=True))
    for d, n in enumerate(shape):
        if mapped.get(d, 1) != 1 or n == 1:
            continue
        axes = layouts.split(eqn.outputs[0], d)
        if axes and n % math.prod(sizes[a] for a in axes) == 0:
            return GroupedEqn((), 0, d, axes)
    return None
