"""A parameter's gradient contraction kept as per-group partial sums over the microbatches,
where its stage's plan reduces it once per step.

A stage plan may make a parameter's gradient from operands split along what the gradient
sums over (the head's kernel gradient ``h^T dy`` from a batch split over ``x``): each
device then holds a partial sum, reduced over ``x``. The plan prices that reduction once per
step, after the microbatches' partial sums are added up (``compiler.inter_op.step_parts.
amortise``, as Alpa and Megatron-LM accumulate gradients). Left to ``jax.vjp``, the
runtime's backward returns the gradient itself, so XLA reduces it in every microbatch's
backward: ``m`` reductions where the plan has one. ``runtime.param_copies`` avoids that
where the forward's batch split meets the parameter; a contraction the plan splits only in
the backward (the transpose of a head whose forward splits the vocabulary) it cannot reach.

So where the plan says so (``StagePlan.contraction_shardings``' ``"eqn:k:sum"`` keys,
``compiler.inter_op.piece_plan.partial_sum_specs``), that transpose computes its partial
sums per group, ``[*blocks, *parameter.shape]`` with the blocks split over the reduced axes
(no collective), and gives them out as the cotangent of a *sink*: an extra input of zeros
the forward never reads (``ir.cotangent_marks.dot_with_held_backward``). The pipeline
accumulates each sink in the parameter's place, the rest of its gradient folded into the
first block (``fold_into_sinks``: one accumulator per parameter), and sums the blocks after
the last microbatch (``add_partial_sums``, which sums ``runtime.param_copies``' groups too):
the plan's one reduction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.ir.cotangent_marks import SUM, parse_contraction_key, viewed_parameter
from autopar.ir.program import FlatEqn, FlatProgram, bind_eqn
from autopar.plan import ShardingSpec
from autopar.runtime.param_copies import ParamCopies

__all__ = ["GradientSink", "add_partial_sums", "fold_into_sinks", "plan_sinks", "unsunk"]


@dataclass(frozen=True)
class GradientSink:
    """Where contraction ``eqn``'s transpose making operand ``operand``'s gradient (parameter
    ``param``, or a view of it made by the ``chain`` of equations) puts its partial sums: per
    ``(result dimension, blocks)`` of ``groups``, the blocks split over the mesh axes of
    ``axes``."""

    eqn: int
    operand: int
    param: int
    chain: tuple[int, ...]
    groups: tuple[tuple[int, int], ...]
    axes: tuple[tuple[str, ...], ...]
    shape: tuple[int, ...]  # the parameter's
    dtype: Any

    def sharding(self, mesh: Mesh, ndim: int) -> NamedSharding:
        """The layout of partial sums of ``ndim`` dimensions (after the blocks): the blocks
        over their axes, the rest as XLA likes."""
        rest = [PartitionSpec.UNCONSTRAINED] * ndim
        return NamedSharding(mesh, PartitionSpec(*self.axes, *rest))

    def zeros(self, mesh: Mesh) -> Any:
        """The sink itself: zeros the forward never reads (only its cotangent matters)."""
        blocks = tuple(g for _, g in self.groups)
        return jax.lax.with_sharding_constraint(
            jnp.zeros((*blocks, *self.shape), self.dtype), self.sharding(mesh, len(self.shape)))

    def through(self, eqn: FlatEqn, value: Any) -> Any:
        """The sink ``value`` passed through view ``eqn`` of its ``chain``, block by block:
        the partial sums then come back through its transpose."""
        def view(x: Any) -> Any:
            return bind_eqn(eqn, [x])[0]

        for _ in self.groups:
            view = jax.vmap(view)
        return view(value)


def plan_sinks(forward: FlatProgram, eqns: Sequence[int], params: Sequence[int],
               contraction_specs: dict[str, ShardingSpec], copies: ParamCopies,
               sizes: dict[str, int]) -> list[GradientSink]:
    """The sinks of the piece of equations ``eqns`` (parameters ``params``), on a mesh of
    axis ``sizes``: each ``"eqn:k:sum"`` of the stage plan's ``contraction_specs`` whose
    operand ``k`` is one of the piece's parameters, read as it is (not as copies:
    ``runtime.param_copies`` reduces those once per step already)."""
    inside, own = set(eqns), set(params) - set(copies.params)
    made = {v: forward.eqns[i] for i in eqns for v in forward.eqns[i].outputs}
    sinks = []
    for key, spec in sorted(contraction_specs.items()):
        i, k, role = parse_contraction_key(key)
        if role != SUM or i not in inside:
            continue
        eqn = forward.eqns[i]
        result = forward.avals[eqn.outputs[0]].shape
        cuts = [(d, axes, math.prod(sizes[a] for a in axes))
                for d, axes in enumerate(spec.dims) if axes]
        viewed = viewed_parameter(made, eqn.inputs[k], own)
        if viewed is None or any(v in copies.copies for v in eqn.inputs) \
                or any(result[d] % g for d, _, g in cuts):
            continue
        param, chain = viewed
        aval = forward.avals[param]
        sinks.append(GradientSink(i, k, param, chain, tuple((d, g) for d, _, g in cuts),
                                  tuple(tuple(axes) for _, axes, _ in cuts),
                                  tuple(aval.shape), aval.dtype))
    return sinks


def fold_into_sinks(params: Sequence[int], grads: Sequence[Any],
                    sinks: Sequence[GradientSink], partials: Sequence[Any]) -> list[Any]:
    """What a piece accumulates over the microbatches: the gradients of its parameters
    that have no sink (in ``params`` order), then each sink's partial sums (in ``sinks``
    order), the first sink of a parameter with the rest of that parameter's gradient
    (``grads``, what did not go to a sink) added into its first block. So a parameter
    with a sink has one accumulator, not two: the sum of its sinks' blocks is its gradient."""
    first: dict[int, int] = {}
    for j, s in enumerate(sinks):
        first.setdefault(s.param, j)
    out = [g for v, g in zip(params, grads, strict=True) if v not in first]
    for j, (s, part) in enumerate(zip(sinks, partials, strict=True)):
        if first[s.param] == j:
            rest = grads[list(params).index(s.param)]
            part = part.at[(0,) * len(s.groups)].add(rest.astype(part.dtype))
        out.append(part)
    return out


def unsunk(params: Sequence[int], sinks: Sequence[GradientSink]) -> list[int]:
    """The parameters among ``params`` without a sink: ``fold_into_sinks``' first ones."""
    sunk = {s.param for s in sinks}
    return [v for v in params if v not in sunk]


@partial(jax.jit, static_argnums=1)
def add_partial_sums(partials: list[list[Any]], blocks: tuple[tuple[int, ...], ...]
                     ) -> list[Any]:
    """Each parameter's gradient from its sinks' partial sums (``partials[j]``: parameter
    ``j``'s, each ``[*blocks, *shape]``; ``blocks[j]``: how many block dimensions each
    has): the plan's one reduction of them."""
    return [sum(p.sum(axis=tuple(range(b))) for p, b in zip(ps, bs, strict=True))
            for ps, bs in zip(partials, blocks, strict=True)]
