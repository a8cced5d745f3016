"""Strategies for ``dot_general``: batch, free (M/N) and contracting (K) splits.

``dimension_numbers = ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``; the output's
dimensions are the batch dimensions, then the lhs free dimensions, then the rhs free ones. Each
mesh axis goes to nothing, one batch pair, one lhs free dim, one rhs free dim, or one
contracting pair (see :func:`slot_strategies`). A split contracting pair leaves partial sums:
all-reduced, or reduce-scattered onto any output dimension.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.compiler.cost.gemm import CONTRACTING, dot_loops, gemm_efficiency
from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext
from autopar.compiler.intra_op.strategies.compute_common import Slot, finalize, slot_strategies


def dot_slots(
    lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dimension_numbers: tuple
) -> list[Slot]:
    """The loops of a dot_general (``cost.gemm.dot_loops``): batch, lhs free, rhs free
    (parallel, each the next output dimension), contracting (summed)."""
    slots, out = [], 0
    for role, size, dims in dot_loops(lhs_shape, rhs_shape, dimension_numbers):
        if role == CONTRACTING:
            slots.append(Slot(size, dims))
        else:
            slots.append(Slot(size, dims, ((0, out),)))
            out += 1
    return slots


def dot_general_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Every axis assignment; contracting splits all-reduce or reduce-scatter the output."""
    if len(ctx.inputs) != 2 or len(ctx.outputs) != 1:
        return finalize(ctx, [])  # not the plain two-operand form: replicated only
    lhs, rhs = ctx.inputs
    numbers = ctx.node.params["dimension_numbers"]
    slots = dot_slots(lhs.shape, rhs.shape, numbers)
    multiprocessors = ctx.mesh.device.multiprocessors
    if not multiprocessors:
        return slot_strategies(ctx, slots, scatter_dims=range(ctx.outputs[0].ndim))
    # each strategy's per-device GEMM at its waves (``cost.gemm``); slots in loop order
    roles = [role for role, _, _ in dot_loops(lhs.shape, rhs.shape, numbers)]
    return slot_strategies(ctx, slots, scatter_dims=range(ctx.outputs[0].ndim),
                           shape_efficiency=lambda sizes: gemm_efficiency(sizes, roles,
                                                                          multiprocessors))


RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    "dot_general": dot_general_strategies,
}
