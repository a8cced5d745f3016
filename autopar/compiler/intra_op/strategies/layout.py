"""Strategies for pure data-movement ops: broadcast_in_dim, reshape, transpose, squeeze,
expand_dims. All are free (no flops, no communication) when the operand arrives split the way
the output's split implies; the slots (see :mod:`compute_common`) say which splits those are.

* ``broadcast_in_dim``: operand dim d is output dim ``broadcast_dimensions[d]``; it carries
  the output's axes when the sizes match (a size-1 operand dim is broadcast: whole). A new
  output dim splits for free: each device materialises its own slice.
* ``transpose``: output dim i is operand dim ``permutation[i]``.
* ``squeeze`` / ``expand_dims``: the removed / added dims have size 1 and never split.
* ``stack`` / ``unstack`` (``jnp.stack``, ``jnp.unstack`` in jax 0.10: rotary embeddings):
  the other dims keep their axes in every operand and result; the stacked dim stays whole
  (XLA lowers a stack to a concatenation, and splitting that dim made it exchange the
  operands all-to-all rather than pick each device's own: measured).
* ``tile``: a repeated dim stays whole, the others keep their axes.
* ``reshape``: operand and output dims fall into groups of equal products (a merge, a split,
  or a general regrouping; size-1 dims are ignored). The block distribution of a group's
  flat index range over n devices is the block distribution of its major-most dim iff that
  dim divides by n, so within each group only the major-most output dim may split, and only
  together with the major-most operand dim, both divisible: one slot of size gcd(the two).
  Every other dim of a group stays whole (its split would be a strided piece).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext
from autopar.compiler.intra_op.strategies.compute_common import Slot, finalize, slot_strategies


def broadcast_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Every output spec; the operand keeps the axes of the dims it really has."""
    out = ctx.outputs[0]
    operand = ctx.inputs[0]
    source = {int(o): d for d, o in enumerate(ctx.node.params["broadcast_dimensions"])}
    slots = []
    for j, size in enumerate(out.shape):
        d = source.get(j)
        ins = ((0, d),) if d is not None and operand.shape[d] == size else ()
        slots.append(Slot(size, ins, ((0, j),)))
    return slot_strategies(ctx, slots)


def transpose_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Output dim i carries operand dim ``permutation[i]``'s axes."""
    perm = ctx.node.params["permutation"]
    shape = ctx.inputs[0].shape
    return slot_strategies(ctx, [Slot(shape[p], ((0, int(p)),), ((0, i),))
                                 for i, p in enumerate(perm)])


def _same_dims(ctx: StrategyContext, kept_in: Sequence[int], kept_out: Sequence[int]) -> list[Slot]:
    """Slots pairing the ``k``-th kept operand dim with the ``k``-th kept output dim."""
    shape = ctx.inputs[0].shape
    return [Slot(shape[i], ((0, i),), ((0, j),))
            for i, j in zip(kept_in, kept_out, strict=True)]


def squeeze_strategies(ctx: StrategyContext) -> list[Strategy]:
    """The removed (size-1) dims stay whole; the rest keep their axes."""
    rank = ctx.inputs[0].ndim
    gone = {int(d) % rank for d in ctx.node.params["dimensions"]}
    kept = [d for d in range(rank) if d not in gone]
    return slot_strategies(ctx, _same_dims(ctx, kept, range(len(kept))))


def expand_dims_strategies(ctx: StrategyContext) -> list[Strategy]:
    """The added (size-1) dims stay whole; the rest keep their axes."""
    rank = ctx.outputs[0].ndim
    added = {int(d) % rank for d in ctx.node.params["dimensions"]}
    kept = [d for d in range(rank) if d not in added]
    return slot_strategies(ctx, _same_dims(ctx, range(len(kept)), kept))


def stack_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Output dim ``axis`` is new and whole; the others carry every operand's dim in order."""
    axis = int(ctx.node.params["axis"]) % ctx.outputs[0].ndim
    operands = range(len(ctx.inputs))
    return slot_strategies(ctx, [
        Slot(size, tuple((k, j if j < axis else j - 1) for k in operands), ((0, j),))
        for j, size in enumerate(ctx.outputs[0].shape) if j != axis])


def unstack_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Operand dim ``axis`` stays whole; the others carry into every result in order."""
    shape = ctx.inputs[0].shape
    axis = int(ctx.node.params["axis"]) % len(shape)
    results = range(len(ctx.outputs))
    return slot_strategies(ctx, [
        Slot(size, ((0, d),), tuple((k, d if d < axis else d - 1) for k in results))
        for d, size in enumerate(shape) if d != axis])


def tile_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Dims repeated (``reps`` > 1) stay whole: a block of the output is not the operand's
    block; the others keep their axes."""
    shape = ctx.inputs[0].shape
    reps = ctx.node.params["reps"]
    return slot_strategies(ctx, [Slot(size, ((0, d),), ((0, d),))
                                 for d, size in enumerate(shape) if int(reps[d]) == 1])


def reshape_groups(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Operand and output dims (size-1 dims left out) in minimal groups of equal products."""
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        gi, go = [ins[i]], [outs[j]]
        pi, po = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po and i < len(ins):
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            elif po < pi and j < len(outs):
                go.append(outs[j])
                po *= out_shape[outs[j]]
                j += 1
            else:
                return []  # sizes do not match up (cannot happen for a valid reshape)
        groups.append((gi, go))
    return groups


def reshape_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Per group, the major-most output dim splits with the major-most operand dim."""
    if ctx.node.params.get("dimensions") is not None or len(ctx.inputs) != 1:
        return finalize(ctx, [])  # reshape with a built-in transpose: replicated only
    in_shape, out_shape = ctx.inputs[0].shape, ctx.outputs[0].shape
    slots = [Slot(math.gcd(in_shape[gi[0]], out_shape[go[0]]), ((0, gi[0]),), ((0, go[0]),))
             for gi, go in reshape_groups(in_shape, out_shape)]
    return slot_strategies(ctx, slots)


RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    "broadcast_in_dim": broadcast_strategies,
    "reshape": reshape_strategies,
    "transpose": transpose_strategies,
    "squeeze": squeeze_strategies,
    "expand_dims": expand_dims_strategies,
    "stack": stack_strategies,
    "unstack": unstack_strategies,
    "tile": tile_strategies,
}
