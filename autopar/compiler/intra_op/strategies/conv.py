"""Strategies for ``conv_general_dilated``.

``dimension_numbers`` gives, per tensor, (batch, feature, spatial...) for lhs and output and
(out-feature, in-feature, spatial...) for rhs. Spatial dimensions are never split (that needs
halo exchange). The loops, by case:

* plain (no groups): batch (lhs N <-> out N), output channels (rhs O <-> out C), input
  channels (lhs C <-> rhs I, summed: all-reduce, or reduce-scatter onto out N or out C);
* ``feature_group_count`` G > 1, depthwise (G = lhs C, any channel multiplier): batch, and
  groups — lhs C, rhs O and out C cut together into blocks of whole groups (G divisible by the
  devices), each device running a grouped conv of G/n groups. Splitting only rhs O would cut
  across groups; not offered. Other grouped convs (1 < G < C) get the replicated strategy
  only: XLA's SPMD partitioner (jax 0.10.2) all-gathers the lhs and computes the whole conv
  on every device for every split tried (batch, groups), so no split is really parallel;
* ``batch_group_count`` B > 1 (weight gradients of grouped convs: the lhs batch is cut into B
  groups, group b producing output features block b): batch groups — lhs N, rhs O and out C
  cut together into blocks of whole groups (B divisible), and input channels (lhs C <-> rhs I,
  summed as above; this is the data-parallel weight gradient). The output batch (N/B) is not
  split: its block is a strided, not a contiguous, piece of the lhs batch. Two XLA limits
  restrict the summed splits (both seen with jax 0.10.2 on a 2x4 CPU mesh): with an active
  mesh axis left unused, XLA all-reduces the partial sums over the whole mesh instead of the
  summing axes (the result comes out multiplied by the unused axis' size), so summed splits
  must use every active axis; and a reduce-scatter onto the out-feature dim minor to the
  batch-group axes becomes all-to-alls/all-gathers, so scatters go to unsplit dims only.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext
from autopar.compiler.intra_op.strategies.compute_common import (
    Slot,
    active_axes,
    finalize,
    slot_strategies,
)


def conv_slots(
    lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], params: dict
) -> list[Slot]:
    """The splittable loops of a convolution (see the module docstring)."""
    dn = params["dimension_numbers"]
    ln, lc = dn.lhs_spec[:2]
    ro, ri = dn.rhs_spec[:2]
    on, oc = dn.out_spec[:2]
    groups = int(params.get("feature_group_count", 1))
    batch_groups = int(params.get("batch_group_count", 1))
    channels = Slot(lhs_shape[lc], ((0, lc), (1, ri)))  # summed: partial sums
    if batch_groups > 1:
        return [Slot(batch_groups, ((0, ln), (1, ro)), ((0, oc),)), channels]
    batch = Slot(lhs_shape[ln], ((0, ln),), ((0, on),))
    if groups > 1:
        if groups != lhs_shape[lc]:
            return []  # not depthwise: XLA runs no split in parallel (module docstring)
        return [batch, Slot(groups, ((0, lc), (1, ro)), ((0, oc),))]
    return [batch, Slot(rhs_shape[ro], ((1, ro),), ((0, oc),)), channels]


def _xla_safe_batch_group(ctx: StrategyContext, strategy: Strategy) -> bool:
    """Whether a batch_group_count > 1 strategy avoids the XLA limits in the docstring."""
    if not strategy.collectives:
        return True
    used = {a for spec in strategy.input_specs if spec for axes in spec.dims for a in axes}
    if used != set(active_axes(ctx)):
        return False
    summed = {ctx.axis_names[i] for c in strategy.collectives for i in c.axes}
    return all(not summed & set(axes) or set(axes) == summed
               for axes in strategy.output_specs[0].dims)


def conv_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Batch / channel / group splits; input-channel splits all-reduce or reduce-scatter."""
    if len(ctx.inputs) != 2 or len(ctx.outputs) != 1:
        return finalize(ctx, [])
    lhs, rhs = ctx.inputs
    params = dict(ctx.node.params)
    out_spec = params["dimension_numbers"].out_spec
    found = slot_strategies(ctx, conv_slots(lhs.shape, rhs.shape, params),
                            scatter_dims=out_spec[:2])
    if int(params.get("batch_group_count", 1)) > 1:
        found = [s for s in found if _xla_safe_batch_group(ctx, s)]
    return finalize(ctx, found)


RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    "conv_general_dilated": conv_strategies,
}
