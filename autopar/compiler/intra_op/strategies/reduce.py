"""Strategies for reductions (``reduce_*``, ``argmax``/``argmin``).

A reduction is a loop over every operand dim: kept dims are parallel slots (operand dim <->
output dim), reduced dims are summed slots. Splitting a reduced dim leaves each device a
partial result of its block; one all-reduce with the op's own combiner (add, max, min, mul,
and, or, xor) completes it — nbytes is the per-device output buffer.

``argmax``/``argmin`` are not offered split reduced dims: a partial winner's index is local to
its block and combining needs (value, index) pairs, which one all-reduce does not carry.
Neither is ``reduce_xor``: XLA's CPU backend rejects an xor all-reduce ("Unsupported
reduction computation", jax 0.10.2) and NCCL has no xor reduction either.
Cumulative ops (``cumsum``, ...) belong to ``slicing.py`` (split along every dim but ``axis``).
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext
from autopar.compiler.intra_op.strategies.compute_common import Slot, finalize, slot_strategies


def reduction_strategies(ctx: StrategyContext, split_reduced: bool = True) -> list[Strategy]:
    """Kept dims split freely; reduced dims split with an all-reduce (if ``split_reduced``)."""
    if len(ctx.inputs) != 1 or len(ctx.outputs) != 1:
        return finalize(ctx, [])
    shape = ctx.inputs[0].shape
    reduced = {int(a) for a in ctx.node.params["axes"]}
    slots, out = [], 0
    for d, size in enumerate(shape):
        if d in reduced:
            if split_reduced:
                slots.append(Slot(size, ((0, d),)))
            continue
        slots.append(Slot(size, ((0, d),), ((0, out),)))
        out += 1
    return slot_strategies(ctx, slots, reduce_scatter=False)


def kept_dims_strategies(ctx: StrategyContext) -> list[Strategy]:
    """argmax/argmin/reduce_xor: only the kept dims split (see the module docstring)."""
    return reduction_strategies(ctx, split_reduced=False)


# the reductions offered split reduced dims (each device reduces its block, an all-reduce
# completes it)
SPLIT_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                              "reduce_and", "reduce_or"})

RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    **{name: reduction_strategies for name in sorted(SPLIT_REDUCTIONS)},
    **{name: kept_dims_strategies for name in ("argmax", "argmin", "reduce_xor")},
}
