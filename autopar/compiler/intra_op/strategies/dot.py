"""Strategies for ``dot_general``: batch, free (M/N) and contracting (K) splits.

``dimension_numbers = ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``; the output's
dimensions are the batch dimensions, then the lhs free dimensions, then the rhs free ones. Each
mesh axis goes to nothing, one batch pair, one lhs free dim, one rhs free dim, or one
contracting pair (see :func:`slot_strategies`). A split contracting pair leaves partial sums:
all-reduced, or reduce-scattered onto any output dimension.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.compiler.cost.gemm import BATCH, COLUMNS, CONTRACTING, ROWS, gemm_efficiency
from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext
from autopar.compiler.intra_op.strategies.compute_common import Slot, finalize, slot_strategies


def dot_slots(
    lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dimension_numbers: tuple
) -> list[Slot]:
    """The loops of a dot_general: batch, lhs free, rhs free (parallel), contracting (summed)."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    lhs_free = [d for d in range(len(lhs_shape)) if d not in lhs_c and d not in lhs_b]
    rhs_free = [d for d in range(len(rhs_shape)) if d not in rhs_c and d not in rhs_b]
    slots = [Slot(lhs_shape[lb], ((0, lb), (1, rb)), ((0, i),))
             for i, (lb, rb) in enumerate(zip(lhs_b, rhs_b, strict=True))]
    out = len(lhs_b)
    for d in lhs_free:
        slots.append(Slot(lhs_shape[d], ((0, d),), ((0, out),)))
        out += 1
    for d in rhs_free:
        slots.append(Slot(rhs_shape[d], ((1, d),), ((0, out),)))
        out += 1
    slots += [Slot(lhs_shape[lc], ((0, lc), (1, rc)))
              for lc, rc in zip(lhs_c, rhs_c, strict=True)]
    return slots


def dot_general_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Every axis assignment; contracting splits all-reduce or reduce-scatter the output."""
    if len(ctx.inputs) != 2 or len(ctx.outputs) != 1:
        return finalize(ctx, [])  # not the plain two-operand form: replicated only
    lhs, rhs = ctx.inputs
    slots = dot_slots(lhs.shape, rhs.shape, ctx.node.params["dimension_numbers"])
    multiprocessors = ctx.mesh.device.multiprocessors
    if not multiprocessors:
        return slot_strategies(ctx, slots, scatter_dims=range(ctx.outputs[0].ndim))
    roles = [gemm_role(slot) for slot in slots]
    return slot_strategies(ctx, slots, scatter_dims=range(ctx.outputs[0].ndim),
                           shape_efficiency=lambda sizes: gemm_efficiency(sizes, roles,
                                                                          multiprocessors))


def gemm_role(slot: Slot) -> str:
    """What a dot's loop is to its GEMM's output tiles (``cost.gemm``): summed loops are
    contracting, loops over both operands batch, the lhs's free ones rows, the rhs's columns."""
    if slot.summed:
        return CONTRACTING
    if len(slot.inputs) == 2:
        return BATCH
    return ROWS if slot.inputs[0][0] == 0 else COLUMNS


RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    "dot_general": dot_general_strategies,
}
