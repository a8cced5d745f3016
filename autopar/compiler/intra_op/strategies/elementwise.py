"""Strategies for elementwise primitives: every output spec, operands following it.

An elementwise op reads, for each output element, the operand elements at the same index
(size-1 operand dims broadcast, rank-0 operands are scalars). So any split of the output is
communication-free if each operand is split the same way on the dims where its size equals the
output's and kept whole on its broadcast dims. Each output dim is one slot (see
:mod:`compute_common`) tying those operand dims to it.

The same holds for value-preserving ops that are not arithmetic (casts, copies,
``stop_gradient``, ``sharding_constraint``) and for the PRNG plumbing: ``threefry2x32``
broadcasts like arithmetic; ``random_wrap`` / ``random_unwrap`` and a width-changing
``bitcast_convert_type`` add or drop one trailing dim, which is never split — dims are matched
from the front, and an output dim some non-scalar operand lacks gets no slot. (The three PRNG
names are exported as ``PRNG_RULES``, not ``RULES``: ``misc.py`` claims them replicated-only.)

``optimization_barrier`` is the identity on several tensors of unrelated shapes: its outputs
are treated like its operands. One spec is chosen for the highest-rank output and each other
tensor takes the same axes on the same dim index where it has that dim and it divides
(otherwise it stays whole there), so "split everything's leading dim" is one strategy.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.compiler.graph.op_costs import ELEMENTWISE
from autopar.compiler.intra_op.strategies.base import (
    Strategy,
    StrategyContext,
    divisible,
    enumerate_specs,
)
from autopar.compiler.intra_op.strategies.compute_common import (
    Slot,
    finalize,
    make_strategy,
    slot_strategies,
)
from autopar.plan import ShardingSpec


def elementwise_strategies(ctx: StrategyContext) -> list[Strategy]:
    """One strategy per output spec; operands split alike on their non-broadcast dims."""
    outs = ctx.outputs
    if not outs or any(t.shape != outs[0].shape for t in outs):
        return finalize(ctx, [])
    shape = outs[0].shape
    operands = [(i, t) for i, t in enumerate(ctx.inputs) if t.ndim > 0]
    slots = []
    for d, size in enumerate(shape):
        if any(t.ndim <= d for _, t in operands):
            continue  # e.g. the key-data dim random_unwrap adds: whole on every device
        ins = tuple((i, d) for i, t in operands if t.shape[d] == size)
        slots.append(Slot(size, ins, tuple((k, d) for k in range(len(outs)))))
    return slot_strategies(ctx, slots)


def _follow(spec: ShardingSpec, shape: tuple[int, ...], ctx: StrategyContext) -> ShardingSpec:
    """``spec``'s axes on the same dim indices of ``shape``, where they exist and divide."""
    dims = []
    for d, size in enumerate(shape):
        axes = spec.dims[d] if d < spec.ndim else ()
        dims.append(axes if axes and divisible(size, ctx, axes) else ())
    return ShardingSpec(tuple(dims))


def barrier_strategies(ctx: StrategyContext) -> list[Strategy]:
    """``optimization_barrier``: identity on each operand; every tensor follows one spec."""
    outs = ctx.outputs
    if not outs or len(outs) != len(ctx.inputs):
        return finalize(ctx, [])
    ref = max(range(len(outs)), key=lambda k: (outs[k].ndim, outs[k].size))
    found = []
    for spec in enumerate_specs(outs[ref].shape, ctx):
        specs = [_follow(spec, t.shape, ctx) for t in outs]
        ins = [s if t.ndim else None for s, t in zip(specs, ctx.inputs, strict=True)]
        found.append(make_strategy(ctx, specs, ins, [a for axes in spec.dims for a in axes]))
    return finalize(ctx, found)


_NAMES = sorted(ELEMENTWISE) + [
    "convert_element_type", "copy", "copy_p", "reduce_precision", "bitcast_convert_type",
    "stop_gradient", "sharding_constraint",
    # the layout change JAX's autodiff emits (on the cotangent seed): the plan sets layouts
    "reshard", "device_put",
    # ``jax.lax.stage``: lifts a value into the trace, the identity
    "stage",
    # ``jax.ad_checkpoint.checkpoint_name``: a label for the rematerialisation policy, the
    # identity on its operand (replicated, it gathered every named activation)
    "name",
]

RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    name: elementwise_strategies for name in _NAMES
}
RULES["optimization_barrier"] = barrier_strategies

# The PRNG plumbing is elementwise too (bit-exact when split: tested), but ``misc.py`` claims
# these names replicated-only and the registry refuses two claims. Merge these into RULES
# once misc.py lets them go.
PRNG_RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    name: elementwise_strategies for name in ("random_wrap", "random_unwrap", "threefry2x32")
}
