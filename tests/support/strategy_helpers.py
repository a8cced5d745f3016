"""Helpers shared by the strategy-family tests (test_strategies_*.py).

Imported as a plain module: pytest puts tests/ (no __init__.py) on sys.path for its test files.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from autopar.compiler.intra_op.strategies.base import Strategy
from autopar.plan import ShardingSpec


def sds(*shape: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    """An abstract argument: shape and dtype, nothing allocated."""
    return jax.ShapeDtypeStruct(shape, dtype)


def pspec(spec: ShardingSpec | None) -> PartitionSpec:
    """ShardingSpec -> PartitionSpec: () -> None, (a,) -> a, (a, b) -> (a, b); None (a rank-0
    operand) -> fully replicated."""
    if spec is None:
        return PartitionSpec()
    return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else tuple(a)
                           for a in spec.dims])


def sample(strategies: list[Strategy], k: int) -> list[Strategy]:
    """About ``k`` strategies spread evenly over the list (the replicated one is first)."""
    step = max(1, math.ceil(len(strategies) / k))
    return strategies[::step]
