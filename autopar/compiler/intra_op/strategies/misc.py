"""Strategies for value-creating primitives: iota, other constant makers, random numbers.

* ``iota``, ``empty``, ``iota_2x32_shape`` take no operands and each element depends only on
  its own position: any output spec is free (each device makes its own block). All outputs
  (``iota_2x32_shape`` has two of the same shape) share the spec.
* Random-number primitives (``random_bits``, ``random_seed``, ``random_split``,
  ``random_fold_in``, ``random_wrap``, ``random_unwrap``, ``random_clone``, ``random_gamma``,
  ``rng_bit_generator``, ``rng_uniform``, ``threefry2x32``) are replicated only. Their values
  depend on the whole key and, for the bit generators, on the position in the whole output;
  whether a sharded run reproduces them bit for bit depends on the PRNG implementation
  (``jax_threefry_partitionable``), so no split is claimed. Their outputs are small or cheap
  compared with what consumes them; the consumer's spec is reached by a free local slice.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext, enumerate_specs
from autopar.compiler.intra_op.strategies.data_common import (
    make_strategy,
    replicated_strategy,
    spec_axes,
    spec_name,
)

__all__ = ["RULES", "constant_strategies", "random_strategies"]


def constant_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Any spec of the output shape, given to every output; no operands, no communication.

    Falls back to replicated when outputs differ in shape or the node has operands (no known
    constant maker does; this keeps the rule safe if one appears)."""
    outs = ctx.outputs
    if ctx.inputs or not outs or any(o.shape != outs[0].shape for o in outs):
        return [replicated_strategy(ctx)]
    result = []
    for spec in enumerate_specs(outs[0].shape, ctx):
        specs = [spec] * len(outs)
        result.append(make_strategy(ctx, spec_name(spec), specs, [], spec_axes(spec)))
    return result


def random_strategies(ctx: StrategyContext) -> list[Strategy]:
    """Replicated only (see the module docstring for why)."""
    return [replicated_strategy(ctx)]


_CONSTANTS = ("iota", "empty", "iota_2x32_shape")
_RANDOM = (
    "random_bits",
    "random_seed",
    "random_split",
    "random_fold_in",
    "random_wrap",
    "random_unwrap",
    "random_clone",
    "random_gamma",
    "rng_bit_generator",
    "rng_uniform",
    "threefry2x32",
)

RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    **{name: constant_strategies for name in _CONSTANTS},
    **{name: random_strategies for name in _RANDOM},
}
