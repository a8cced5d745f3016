"""A piece's ``jax.vjp`` residuals less the parameters it read, which the backward gets back
from its caller.

A parameter is one array per step, but a forward program that returns it among the vjp
function's leaves returns a new buffer: jax 0.10.2's ``jax.jit`` copies an input it returns
(checked on XLA:CPU: the result's buffer is not the argument's). Each microbatch in flight
would then hold one more copy of its piece's parameters (or of their per-group copies,
``runtime.param_copies``) until its backward ran. So the forward returns the other leaves
only, and the backward puts the parameters it is given back in their places (the synchronous
runner: the step's parameters, or their copies; the asynchronous one: the version the
forward read, from its weight store).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

__all__ = ["ResidualLayout"]


@dataclass
class ResidualLayout:
    """Which leaf of one piece's vjp function is which parameter. Set when the piece's
    forward is traced (every trace of it gives the same layout); its backward, traced after,
    reads it."""

    tree: Any = None
    slots: tuple[int, ...] = ()  # per leaf: the parameter's position, or -1 (a residual)

    def split(self, vjp_fn: Any, params: Sequence[Any]) -> list[Any]:
        """The leaves of ``vjp_fn`` that are not one of ``params`` (tracers of the forward
        being traced), recording where the parameters go."""
        leaves, self.tree = jax.tree.flatten(vjp_fn)
        where = {id(p): k for k, p in enumerate(params)}
        self.slots = tuple(where.get(id(x), -1) for x in leaves)
        return [x for x, k in zip(leaves, self.slots, strict=True) if k < 0]

    def vjp(self, params: Sequence[Any], residuals: Sequence[Any]) -> Any:
        """The vjp function again, from ``params`` and the forward's ``residuals``."""
        rest = iter(residuals)
        return jax.tree.unflatten(
            self.tree, [params[k] if k >= 0 else next(rest) for k in self.slots])
