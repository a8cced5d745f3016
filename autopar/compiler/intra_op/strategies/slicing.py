"""Strategies for slicing-like primitives: slices, pads, concatenation, scans along an axis,
sorts, top-k and pooling windows.

All of them act along some dimensions and are independent along the others, so each gets
:func:`same_layout_strategies` with its "blocked" dimensions — the ones it slices, pads,
reverses, concatenates, splits, scans, sorts or slides a window over — kept whole. Splitting a
blocked dimension would need halo exchanges or a distributed sort; none is offered (the
producer's spec is resharded on the edge instead). No strategy communicates, except the split
strategies of ``top_k``, which claim the all-gather XLA inserts (see :func:`_top_k`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext
from autopar.compiler.intra_op.strategies.data_common import (
    make_strategy,
    same_layout_strategies,
    spec_axes,
)
from autopar.plan import CollectiveKind

__all__ = ["RULES", "pooling_blocked_dims"]


def _slice(ctx: StrategyContext) -> list[Strategy]:
    """``slice``: dims whose size changes (start, limit or stride) stay whole."""
    src, out = ctx.inputs[0], ctx.outputs[0]
    blocked = {d for d in range(out.ndim) if out.shape[d] != src.shape[d]}
    return same_layout_strategies(ctx, blocked)


def _pad(ctx: StrategyContext) -> list[Strategy]:
    """``pad`` (operand, padding value): dims with any nonzero low, high or interior padding
    (negative: cropping) stay whole — the block boundaries would shift."""
    config = ctx.node.params["padding_config"]
    blocked = {d for d, (lo, hi, interior) in enumerate(config) if lo or hi or interior}
    return same_layout_strategies(ctx, blocked)


def _rev(ctx: StrategyContext) -> list[Strategy]:
    """``rev``: reversed dims stay whole (a device's block would come from its mirror)."""
    return same_layout_strategies(ctx, set(ctx.node.params["dimensions"]))


def _dynamic_slice(ctx: StrategyContext) -> list[Strategy]:
    """``dynamic_slice`` (operand, *scalar starts): sliced dims stay whole. On a dim taken
    whole the start is clamped to 0, so every device's block is its own."""
    src = ctx.inputs[0]
    sizes = ctx.node.params["slice_sizes"]
    return same_layout_strategies(ctx, {d for d, s in enumerate(sizes) if s != src.shape[d]})


def _dynamic_update_slice(ctx: StrategyContext) -> list[Strategy]:
    """``dynamic_update_slice`` (operand, update, *scalar starts): operand, update and output
    share one spec; dims where the update is smaller than the operand stay whole."""
    src, upd = ctx.inputs[0], ctx.inputs[1]
    return same_layout_strategies(
        ctx, {d for d in range(src.ndim) if upd.shape[d] != src.shape[d]})


def _concatenate(ctx: StrategyContext) -> list[Strategy]:
    """``concatenate``: the concatenation dim stays whole; every operand gets the output's
    spec."""
    return same_layout_strategies(ctx, {ctx.node.params["dimension"]})


def _split(ctx: StrategyContext) -> list[Strategy]:
    """``split`` (sizes, axis): the split axis stays whole; every output gets the operand's
    spec (enumerated over the operand's shape)."""
    return same_layout_strategies(ctx, {ctx.node.params["axis"]}, ctx.inputs[0].shape)


def _along_axis(param: str) -> Callable[[StrategyContext], list[Strategy]]:
    """Ops that act along one axis named by ``param`` (cumulative ops, sort, approx_top_k);
    the last dimension when the parameter is absent."""

    def rule(ctx: StrategyContext) -> list[Strategy]:
        ndim = ctx.inputs[0].ndim
        axis = ctx.node.params.get(param, ndim - 1)
        return same_layout_strategies(ctx, {axis % ndim}, ctx.inputs[0].shape)

    rule.__doc__ = f"Dimension ``{param}`` stays whole; all operands and outputs share a spec."
    return rule


def _top_k(ctx: StrategyContext) -> list[Strategy]:
    """``top_k`` (operand) -> (values, indices) along ``axis`` (the last dim on older jax).

    Semantically it is independent along the other dims, but XLA (jax 0.10.2) lowers it to a
    ``TopK`` custom call its SPMD partitioner does not split: whatever the specs, it
    all-gathers the operand, runs the whole top-k on every device and slices the results.
    The split strategies therefore claim that all-gather (the whole operand) and the full
    compute, so the ILP sees what will run; they save only the output's re-slicing edge.
    """
    operand = ctx.inputs[0]
    axis = ctx.node.params.get("axis", operand.ndim - 1) % operand.ndim
    result = []
    for s in same_layout_strategies(ctx, {axis}, operand.shape):
        used = spec_axes(s.output_specs[0])
        if not used:
            result.append(s)
            continue
        gather = ctx.collective(CollectiveKind.ALL_GATHER, operand.nbytes, used)
        result.append(make_strategy(ctx, s.name, s.output_specs, s.input_specs, (), [gather]))
    return result


def _param(value: Any, ndim: int, default: int) -> Sequence[Any]:
    """A per-dimension window parameter, or its identity value when the op has none (e.g.
    select_and_scatter_add has no dilations)."""
    return tuple(value) if value is not None else (default,) * ndim


def pooling_blocked_dims(params: Any, ndim: int) -> set[int]:
    """Dims a windowed op (reduce_window*, select_and_*) touches: any window size, stride,
    padding or dilation other than the identity. Only the others can be split freely."""
    windows = _param(params.get("window_dimensions"), ndim, 1)
    strides = _param(params.get("window_strides"), ndim, 1)
    padding = _param(params.get("padding"), ndim, 0)
    base = _param(params.get("base_dilation"), ndim, 1)
    dil = _param(params.get("window_dilation"), ndim, 1)
    blocked = set()
    for d in range(ndim):
        padded = bool(np.any(np.asarray(padding[d]) != 0))  # a (low, high) pair
        if windows[d] != 1 or strides[d] != 1 or padded or base[d] != 1 or dil[d] != 1:
            blocked.add(d)
    return blocked


def _pooling(ctx: StrategyContext) -> list[Strategy]:
    """reduce_window_{max,min,sum}, reduce_window (operands + scalar inits),
    select_and_scatter_add (source, operand), select_and_scatter (operand, source, init),
    select_and_gather_add (tangents, operand): every non-scalar operand and output shares one
    spec, splitting only identity-window dims (where all of them have the same size)."""
    ref = ctx.inputs[0]
    return same_layout_strategies(ctx, pooling_blocked_dims(ctx.node.params, ref.ndim),
                                  ref.shape)


RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    "slice": _slice,
    "pad": _pad,
    "rev": _rev,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "concatenate": _concatenate,
    "split": _split,
    "cumsum": _along_axis("axis"),
    "cumprod": _along_axis("axis"),
    "cummax": _along_axis("axis"),
    "cummin": _along_axis("axis"),
    "cumlogsumexp": _along_axis("axis"),
    "sort": _along_axis("dimension"),
    "top_k": _top_k,
    "approx_top_k": _along_axis("reduction_dimension"),
    "reduce_window_sum": _pooling,
    "reduce_window_max": _pooling,
    "reduce_window_min": _pooling,
    "reduce_window": _pooling,
    "select_and_scatter_add": _pooling,
    "select_and_scatter": _pooling,
    "select_and_gather_add": _pooling,
}
