"""Strategies for control flow: the two ends of an expanded scan region, control flow kept as
single nodes (``scan``, ``while``, ``cond``), and the replicated fallback every unknown
primitive gets.

**Scan regions** (``ir.program``: a scan traced with its body numbered once). The body's
equations are ordinary graph nodes with their per-iteration shapes, so every family's
strategies apply to them; the ILP chooses them once for all iterations (the body *is* one layer,
tied across iterations by construction). Their per-step cost is ``repeat`` runs: flops already
count every iteration (``op_costs``); :func:`repeated` multiplies a strategy's own
communication, and the edges multiply a use's resharding by the consumer's ``repeat``. The
region's ends carry layouts across the loop boundary and cost nothing themselves:

* an *enter* takes any spec ``s`` of the body value it makes and reads its scan operand as
  ``s`` (consts, carries) or as ``s`` behind a whole leading length axis (``xs``: each
  iteration reads its own slice, so the stacked axis is never split);
* an *exit* reads the body's result as ``s`` and makes the scan result as ``s`` (the final
  carry) or ``s`` behind a whole length axis (the stacked ``ys``).

A carry's enter and exit share one decision (``tying.tie_scan_carries``): the loop carry has
one layout, and a body whose new carry comes out in another layout pays the resharding back on
every iteration (the edge into the exit, times the length).

Every control-flow node gets the replicated strategy. It also gets a *batch* strategy — dim 0
of every non-scalar value of its body split over one mesh axis (or over all axes together) —
only when that is provably sound without looking at what the loop computes. The test accepted:

* every equation of every body (scan: ``jaxpr``; while: ``cond_jaxpr`` and ``body_jaxpr``;
  cond: every branch, recursing into inlined calls such as ``pjit``) is elementwise —
  ``op_costs.ELEMENTWISE`` plus type conversions and copies — or a ``broadcast_in_dim`` of a
  rank-0 value (a fill);
* every constant closed into a body is a scalar.

Why that suffices: an elementwise op maps equal-shaped arrays (and rank-0 values) to an array
of the same shape, element by element, so element ``[b, ...]`` of every body value depends only
on elements ``[b, ...]`` of the body's inputs and on rank-0 values; a fill is constant along
dim 0. Rank-0 values can only come from rank-0 values (so a while-loop's predicate, and hence
its trip count, is the same on every device). Splitting dim 0 of every non-scalar body input
and output over the same axes is therefore exact with no communication. Different arrays may
have different leading sizes (elementwise ops never mix them); each must be divisible.

How body dims map to the node's tensors: while and cond carry body values as they are (dim
0); scan slices its ``xs`` and stacks its ``ys`` along a new leading length axis, so for those
the split dim is 1 (consts and carries: dim 0). Rank-0 operands (loop counters, the cond
index) get ``None``; rank-0 scan slices leave their ``xs``/``ys`` whole.

Not accepted (replicated only): bodies with reductions, dots, gathers/scatters, reshapes,
transposes, broadcasts of arrays, iota, random numbers, nested control flow, or array
constants — correct batch strategies exist for many of those, but proving it needs real
dimension tracking through the body, which this module does not do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from autopar.compiler.graph.op_costs import ELEMENTWISE
from autopar.compiler.intra_op.strategies.base import (
    Strategy,
    StrategyContext,
    divisible,
    enumerate_specs,
)
from autopar.compiler.intra_op.strategies.data_common import (
    active_axes,
    input_spec,
    make_strategy,
    replicated_strategy,
    spec_name,
)
from autopar.ir.program import SCAN_ENTER, SCAN_EXIT
from autopar.ir.walk import INLINED_CALLS
from autopar.plan import ShardingSpec

__all__ = ["RULES", "elementwise_body", "repeated", "replicated_strategy"]


def repeated(strategies: Sequence[Strategy], times: int) -> list[Strategy]:
    """``strategies`` of an op that runs ``times`` per step (inside scan regions): its own
    collectives happen every run. Compute is left alone: a node's flops already count every
    run, and its compute time comes from them."""
    if times == 1:
        return list(strategies)
    return [
        dataclasses.replace(
            s,
            communication_time_s=s.communication_time_s * times,
            collectives=tuple(dataclasses.replace(c, count=c.count * times,
                                                  time_s=c.time_s * times)
                              for c in s.collectives),
        )
        for s in strategies
    ]


def _stacked(spec: ShardingSpec) -> ShardingSpec:
    """``spec`` of one slice, as the spec of the stacked array: the length axis whole."""
    return ShardingSpec(((), *spec.dims))


def _scan_enter(ctx: StrategyContext) -> list[Strategy]:
    """Any spec of the body value; the operand alike (``xs``: behind a whole length axis)."""
    body, operand = ctx.outputs[0], ctx.inputs[0]
    xs = ctx.node.params["role"] == "xs"
    result = []
    for spec in _specs(body.shape, ctx):
        need = _stacked(spec) if xs else spec
        result.append(Strategy(spec_name(spec), (spec,), (input_spec(operand, need),)))
    return result


def _scan_exit(ctx: StrategyContext) -> list[Strategy]:
    """Any spec of the body's result, read as it is; the scan result alike (``ys``: behind a
    whole length axis)."""
    body = ctx.inputs[0]
    ys = ctx.node.params["role"] == "ys"
    result = []
    for spec in _specs(body.shape, ctx):
        out = _stacked(spec) if ys else spec
        result.append(Strategy(spec_name(spec), (out,), (input_spec(body, spec),)))
    return result


def _specs(shape: Sequence[int], ctx: StrategyContext) -> list[ShardingSpec]:
    """Every spec of ``shape`` on the mesh, replicated first (a carry's enter and exit list
    them in the same order, so one decision index means one spec at both ends)."""
    if not shape:
        return [ShardingSpec(())]
    return list(enumerate_specs(shape, ctx))

# Conversions and copies are elementwise too; op_costs leaves them out (they cost no flops).
_BODY_OPS = ELEMENTWISE | {"convert_element_type", "copy", "reduce_precision"}


def _open(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """(open jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
    inner = getattr(jaxpr, "jaxpr", None)
    if inner is not None and hasattr(jaxpr, "consts"):
        return inner, jaxpr.consts
    return jaxpr, ()


def elementwise_body(jaxpr: Any) -> bool:
    """Is every equation elementwise or a scalar fill, and every closed constant a scalar?"""
    body, consts = _open(jaxpr)
    if any(np.ndim(c) != 0 for c in consts):
        return False
    for eqn in body.eqns:
        name = eqn.primitive.name
        if name in INLINED_CALLS:
            inner = eqn.params.get(INLINED_CALLS[name])
            if inner is None or not elementwise_body(inner):
                return False
        elif name == "broadcast_in_dim":
            if len(getattr(eqn.invars[0].aval, "shape", ())) != 0:
                return False
        elif name not in _BODY_OPS:
            return False
    return True


def _body_ndims(jaxpr: Any) -> tuple[list[int], list[int]]:
    body, _ = _open(jaxpr)
    ins = [len(getattr(v.aval, "shape", ())) for v in body.invars]
    outs = [len(getattr(v.aval, "shape", ())) for v in body.outvars]
    return ins, outs


def _batch_strategies(
    ctx: StrategyContext, in_dims: Sequence[int | None], out_dims: Sequence[int | None]
) -> list[Strategy]:
    """Split dim ``in_dims[i]`` of operand ``i`` and ``out_dims[j]`` of output ``j`` (``None``:
    left whole) over each single active axis, and over all of them together on a 2-D mesh."""
    axes = active_axes(ctx)
    groups = [(a,) for a in axes] + ([tuple(axes)] if len(axes) > 1 else [])
    tensors = [*zip(ctx.inputs, in_dims, strict=True), *zip(ctx.outputs, out_dims, strict=True)]
    if all(d is None for _, d in tensors):
        return []
    result = []
    for group in groups:
        if not all(d is None or divisible(t.shape[d], ctx, group) for t, d in tensors):
            continue

        def spec(ndim: int, dim: int | None, group: tuple[str, ...] = group) -> ShardingSpec:
            return ShardingSpec.replicated(ndim) if dim is None else ShardingSpec.split(
                ndim, dim, group)

        outputs = [spec(t.ndim, d) for t, d in zip(ctx.outputs, out_dims, strict=True)]
        inputs = [input_spec(t, spec(t.ndim, d))
                  for t, d in zip(ctx.inputs, in_dims, strict=True)]
        result.append(make_strategy(ctx, f"batch:{'+'.join(group)}", outputs, inputs, group))
    return result


def _leading(ndims: Iterable[int], offset: int = 0) -> list[int | None]:
    """Body rank -> node dim to split: ``offset`` for arrays, ``None`` for scalars."""
    return [offset if n > 0 else None for n in ndims]


def _scan(ctx: StrategyContext) -> list[Strategy]:
    """``scan``: consts and carries split on dim 0, xs and ys on dim 1 (dim 0 is the length)."""
    p = ctx.node.params
    result = [replicated_strategy(ctx)]
    if not elementwise_body(p["jaxpr"]):
        return result
    body_in, body_out = _body_ndims(p["jaxpr"])
    n_fixed = p["num_consts"] + p["num_carry"]
    in_dims = _leading(body_in[:n_fixed]) + _leading(body_in[n_fixed:], 1)
    out_dims = _leading(body_out[:p["num_carry"]]) + _leading(body_out[p["num_carry"]:], 1)
    return result + _batch_strategies(ctx, in_dims, out_dims)


def _while(ctx: StrategyContext) -> list[Strategy]:
    """``while`` (cond consts, body consts, carries): everything on dim 0."""
    p = ctx.node.params
    result = [replicated_strategy(ctx)]
    if not (elementwise_body(p["cond_jaxpr"]) and elementwise_body(p["body_jaxpr"])):
        return result
    in_dims = _leading(t.ndim for t in ctx.inputs)
    out_dims = _leading(t.ndim for t in ctx.outputs)
    return result + _batch_strategies(ctx, in_dims, out_dims)


def _cond(ctx: StrategyContext) -> list[Strategy]:
    """``cond`` (index, *operands): operands and outputs on dim 0; the index is rank 0."""
    result = [replicated_strategy(ctx)]
    if not all(elementwise_body(b) for b in ctx.node.params["branches"]):
        return result
    in_dims = [None, *_leading(t.ndim for t in ctx.inputs[1:])]
    out_dims = _leading(t.ndim for t in ctx.outputs)
    return result + _batch_strategies(ctx, in_dims, out_dims)


RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    SCAN_ENTER.name: _scan_enter,
    SCAN_EXIT.name: _scan_exit,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
