"""Shared machinery of the compute families (dot, conv, elementwise, reduce, layout).

Most compute primitives are loop nests: every loop ("slot") runs over one dimension of some
operands and, unless it is summed away, one dimension of each output. A mesh axis given to a
slot splits all those dimensions together, so the devices along it need no data from each
other — except for summed slots, whose split leaves partial sums on every device that one
all-reduce (or a reduce-scatter, leaving the output split further) completes. Describing an op
by its slots turns every family into "list the slots", and one enumerator builds the specs,
the costs and the names the same way for all of them.

Names read ``<operand specs> -> <output specs>`` with each spec written per dimension as ``R``
(whole) or ``S(x)`` / ``S(x,y)`` (split over those mesh axes, major first), ``[]`` for a rank-0
spec and ``_`` for an operand with no requirement; a partial-sum strategy ends in
``| AR(x)`` (all-reduce over x) or ``| RS(x)`` (reduce-scatter over x).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext, divisible
from autopar.plan import CollectiveEstimate, CollectiveKind, ShardingSpec

Dims = tuple[tuple[int, int], ...]  # (tensor index, dimension) pairs


@dataclass(frozen=True)
class Slot:
    """One loop of an op: the operand and output dimensions it runs over, tied together.

    ``size`` is what a split must divide (the dimensions' common extent, or e.g. the group
    count of a grouped convolution, whose dimensions are multiples of it). A slot without
    ``outputs`` is summed over: splitting it leaves partial sums.
    """

    size: int
    inputs: Dims = ()
    outputs: Dims = ()

    @property
    def summed(self) -> bool:
        return not self.outputs


def active_axes(ctx: StrategyContext) -> tuple[str, ...]:
    """Mesh axes that split anything (size-1 axes are never used), in mesh order."""
    return tuple(a for a in ctx.axis_names if ctx.axis_size(a) > 1)


def mesh_order(ctx: StrategyContext, axes: Iterable[str]) -> tuple[str, ...]:
    """``axes`` sorted into mesh order (the major-first order several axes take on one dim)."""
    wanted = set(axes)
    return tuple(a for a in ctx.mesh.axis_names if a in wanted)


def spec_text(spec: ShardingSpec | None) -> str:
    """Compact per-dimension notation used in strategy names (see the module docstring)."""
    if spec is None:
        return "_"
    if spec.ndim == 0:
        return "[]"
    return "".join(f"S({','.join(axes)})" if axes else "R" for axes in spec.dims)


def strategy_name(
    inputs: Sequence[ShardingSpec | None], outputs: Sequence[ShardingSpec], suffix: str = ""
) -> str:
    text = " x ".join(spec_text(s) for s in inputs) + " -> "
    text += ", ".join(spec_text(s) for s in outputs)
    return f"{text} | {suffix}" if suffix else text


def replicated_spec(ndim: int) -> ShardingSpec | None:
    """Whole on every device; ``None`` (no requirement) for rank-0 operands."""
    return ShardingSpec.replicated(ndim) if ndim else None


def per_device_bytes(ctx: StrategyContext, tensor_id: int, spec: ShardingSpec) -> float:
    """Bytes one device holds of tensor ``tensor_id`` laid out as ``spec``."""
    sizes = {a: ctx.axis_size(a) for a in ctx.axis_names}
    return ctx.tensor(tensor_id).nbytes / spec.num_shards(sizes)


def make_strategy(
    ctx: StrategyContext,
    outputs: Sequence[ShardingSpec],
    inputs: Sequence[ShardingSpec | None],
    parallel_axes: Iterable[str],
    collectives: Sequence[CollectiveEstimate] = (),
    suffix: str = "",
    shape_efficiency: float = 1.0,
) -> Strategy:
    """A priced strategy: the node's flops shared by ``parallel_axes`` (at
    ``shape_efficiency``, ``StrategyContext.compute_time``), plus ``collectives``."""
    return Strategy(
        name=strategy_name(inputs, outputs, suffix),
        output_specs=tuple(outputs),
        input_specs=tuple(inputs),
        compute_time_s=ctx.compute_time(ctx.node.flops, mesh_order(ctx, parallel_axes),
                                        shape_efficiency),
        communication_time_s=sum(c.time_s for c in collectives),
        collectives=tuple(collectives),
    )


def replicated_strategy(ctx: StrategyContext, shape_efficiency: float = 1.0) -> Strategy:
    """Everything whole on every device; every device does all the work."""
    outs = [ShardingSpec.replicated(t.ndim) for t in ctx.outputs]
    ins = [replicated_spec(t.ndim) for t in ctx.inputs]
    return make_strategy(ctx, outs, ins, (), shape_efficiency=shape_efficiency)


def finalize(ctx: StrategyContext, strategies: Iterable[Strategy],
             whole_efficiency: float = 1.0) -> list[Strategy]:
    """Drop duplicates (same specs: keep the cheaper), make names unique, make sure the
    replicated strategy (its flops at ``whole_efficiency``) is present (first)."""
    best: dict[tuple, Strategy] = {}
    for s in [replicated_strategy(ctx, whole_efficiency), *strategies]:
        key = (s.output_specs, s.input_specs)
        if key not in best or s.cost < best[key].cost:
            best[key] = s
    result: list[Strategy] = []
    names: set[str] = set()
    for s in best.values():
        name, k = s.name, 2
        while name in names:  # two spec sets that print alike: keep both, told apart
            name, k = f"{s.name} #{k}", k + 1
        names.add(name)
        result.append(s if name == s.name else Strategy(
            name, s.output_specs, s.input_specs, s.compute_time_s, s.communication_time_s,
            s.collectives))
    return result


def _specs(
    ranks: Sequence[int], placed: Sequence[tuple[Slot, tuple[str, ...]]], side: str
) -> list[list[tuple[str, ...]]]:
    dims: list[list[tuple[str, ...]]] = [[() for _ in range(r)] for r in ranks]
    for slot, axes in placed:
        for t, d in getattr(slot, side):
            dims[t][d] = axes
    return dims


def slot_strategies(
    ctx: StrategyContext,
    slots: Sequence[Slot],
    scatter_dims: Sequence[int] = (),
    reduce_scatter: bool = True,
    shape_efficiency: Callable[[Sequence[int]], float] | None = None,
) -> list[Strategy]:
    """Every assignment of the active mesh axes to slots (or to nothing), as strategies.

    Several axes on one slot split it major-first in mesh order; a slot takes axes only if its
    size divides evenly. Axes on summed slots leave partial sums of output 0: one strategy
    all-reduces them (nbytes: the per-device output buffer), and with ``reduce_scatter`` one
    more per output-0 dimension in ``scatter_dims`` leaves that dimension further split by
    those axes (minor to the axes already on it: each device scatters its own block), costing
    a reduce-scatter of the same per-device partial buffer. ``shape_efficiency``: the
    fraction of the peak the op reaches with its slots at these per-device sizes (a GEMM's
    waves, ``cost.gemm``); every strategy's flops are priced at it.
    """
    axes = active_axes(ctx)
    in_ranks = [t.ndim for t in ctx.inputs]
    out_ranks = [t.ndim for t in ctx.outputs]
    found: list[Strategy] = []
    for choice in itertools.product([None, *range(len(slots))], repeat=len(axes)):
        per_slot: dict[int, tuple[str, ...]] = {}
        for axis, s in zip(axes, choice, strict=True):
            if s is not None:
                per_slot[s] = (*per_slot.get(s, ()), axis)
        if not all(divisible(slots[s].size, ctx, a) for s, a in per_slot.items()):
            continue
        placed = [(slots[s], a) for s, a in per_slot.items()]
        efficiency = 1.0 if shape_efficiency is None else shape_efficiency(
            [slot.size // ctx.axes_size(per_slot.get(k, ())) for k, slot in enumerate(slots)])
        ins = [ShardingSpec(tuple(d)) if r else None
               for d, r in zip(_specs(in_ranks, placed, "inputs"), in_ranks, strict=True)]
        outs = [ShardingSpec(tuple(d)) for d in _specs(out_ranks, placed, "outputs")]
        used = [axis for group in per_slot.values() for axis in group]
        summed = mesh_order(
            ctx, (axis for s, group in per_slot.items() if slots[s].summed for axis in group))
        if not summed:
            found.append(make_strategy(ctx, outs, ins, used, shape_efficiency=efficiency))
            continue
        out_id = ctx.node.outputs[0]
        nbytes = per_device_bytes(ctx, out_id, outs[0])
        tag = ",".join(summed)
        ar = ctx.collective(CollectiveKind.ALL_REDUCE, nbytes, summed)
        found.append(make_strategy(ctx, outs, ins, used, [ar], f"AR({tag})", efficiency))
        if not reduce_scatter:
            continue
        rs = ctx.collective(CollectiveKind.REDUCE_SCATTER, nbytes, summed)
        shape = ctx.tensor(out_id).shape
        for d in scatter_dims:
            merged = outs[0].dims[d] + summed
            if not divisible(shape[d], ctx, merged):
                continue
            dims = list(outs[0].dims)
            dims[d] = merged
            scattered = [ShardingSpec(tuple(dims)), *outs[1:]]
            found.append(make_strategy(ctx, scattered, ins, used, [rs], f"RS({tag})",
                                       efficiency))
    whole = 1.0 if shape_efficiency is None else shape_efficiency([s.size for s in slots])
    return finalize(ctx, found, whole)
