"""Helpers shared by the data-movement strategy families (indexing, slicing, misc, control).

Most of these primitives move data without mixing it across the dimensions they leave alone:
a slice, a sort or a pooling window acts along some dimensions and is independent along the
others. Their strategies are therefore "one spec for everything": enumerate output specs that
leave the blocked dimensions (the ones the op acts along) whole, and give every operand of the
output's rank the same spec. Rank-0 operands (start indices, padding values, init values) get
``None``: every device holds them whole.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from autopar.compiler.graph.opgraph import TensorInfo
from autopar.compiler.intra_op.strategies.base import (
    Strategy,
    StrategyContext,
    divisible,
    enumerate_specs,
)
from autopar.plan import CollectiveEstimate, ShardingSpec

__all__ = [
    "REPLICATED",
    "active_axes",
    "input_spec",
    "make_strategy",
    "replicated_strategy",
    "same_layout_strategies",
    "spec_axes",
    "spec_from_axes",
    "spec_name",
    "unique_by_name",
]

REPLICATED = "replicated"


def active_axes(ctx: StrategyContext) -> list[str]:
    """Mesh axes that split something (size > 1), in mesh order."""
    return [a for a in ctx.axis_names if ctx.axis_size(a) > 1]


def input_spec(info: TensorInfo, spec: ShardingSpec) -> ShardingSpec | None:
    """``spec`` for an operand, or ``None`` for a rank-0 one (no requirement: held whole)."""
    return None if info.ndim == 0 else spec


def spec_axes(spec: ShardingSpec) -> tuple[str, ...]:
    """Every mesh axis ``spec`` uses, in dimension order."""
    return tuple(a for axes in spec.dims for a in axes)


def spec_from_axes(dims: Sequence[Sequence[str]]) -> ShardingSpec:
    """A spec from per-dimension axis lists."""
    return ShardingSpec(tuple(tuple(axes) for axes in dims))


def spec_name(spec: ShardingSpec) -> str:
    """Strategy name for a spec: ``replicated`` or its PartitionSpec notation."""
    return REPLICATED if spec.is_replicated else spec.to_string()


def make_strategy(
    ctx: StrategyContext,
    name: str,
    outputs: Sequence[ShardingSpec],
    inputs: Sequence[ShardingSpec | None],
    work_axes: Iterable[str],
    collectives: Sequence[CollectiveEstimate] = (),
) -> Strategy:
    """A strategy whose compute is the node's flops divided over ``work_axes`` and whose
    communication is the sum of its own ``collectives``."""
    return Strategy(
        name=name,
        output_specs=tuple(outputs),
        input_specs=tuple(inputs),
        compute_time_s=ctx.compute_time(ctx.node.flops, tuple(dict.fromkeys(work_axes))),
        communication_time_s=sum(c.time_s for c in collectives),
        collectives=tuple(collectives),
    )


def replicated_strategy(ctx: StrategyContext) -> Strategy:
    """Every operand and output whole on every device; every device does all the work.

    Always valid, whatever the primitive: this is the fallback for unknown primitives.
    """
    outputs = [ShardingSpec.replicated(t.ndim) for t in ctx.outputs]
    inputs = [input_spec(t, ShardingSpec.replicated(t.ndim)) for t in ctx.inputs]
    return make_strategy(ctx, REPLICATED, outputs, inputs, ())


def _fits(info: TensorInfo, spec: ShardingSpec, ctx: StrategyContext) -> bool:
    return all(divisible(size, ctx, axes) for size, axes in zip(info.shape, spec.dims, strict=True))


def same_layout_strategies(
    ctx: StrategyContext,
    blocked: Collection[int],
    ref_shape: Sequence[int] | None = None,
) -> list[Strategy]:
    """Strategies giving one spec to every operand and output of the reference rank.

    ``blocked`` lists dimensions the op acts along (they stay whole). ``ref_shape`` defaults
    to the first output's shape; operands and outputs of that rank share the spec, rank-0
    operands get ``None``. A spec is kept only if it divides every tensor that carries it
    (sizes can differ on blocked dimensions only, but checking all is cheap and safe).
    The work divides over every axis used: the op is independent along unblocked dims.
    """
    shape = tuple(ref_shape if ref_shape is not None else ctx.outputs[0].shape)
    rank = len(shape)
    result: list[Strategy] = []
    for spec in enumerate_specs(shape, ctx):
        if any(spec.dims[d] for d in blocked):
            continue
        tensors = [t for t in (*ctx.inputs, *ctx.outputs) if t.ndim == rank]
        if not all(_fits(t, spec, ctx) for t in tensors):
            continue

        def place(info: TensorInfo, spec: ShardingSpec = spec) -> ShardingSpec:
            # Another rank cannot share the spec: keep it whole (no such operand is known).
            return spec if info.ndim == rank else ShardingSpec.replicated(info.ndim)

        outputs = [place(t) for t in ctx.outputs]
        inputs = [input_spec(t, place(t)) for t in ctx.inputs]
        result.append(make_strategy(ctx, spec_name(spec), outputs, inputs, spec_axes(spec)))
    if not result or result[0].name != REPLICATED:  # enumerate_specs yields it first
        result.insert(0, replicated_strategy(ctx))
    return result


def unique_by_name(strategies: Iterable[Strategy]) -> list[Strategy]:
    """Drop later strategies whose name repeats an earlier one (first wins)."""
    seen: dict[str, Strategy] = {}
    for s in strategies:
        seen.setdefault(s.name, s)
    return list(seen.values())
