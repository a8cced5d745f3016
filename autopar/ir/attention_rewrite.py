"""The loss function's value and gradient with its softmax attentions run as one primitive.

A site the compiler found and checked (``compiler.graph.attention_forms``: the scores matmul,
the scale, a causal mask or none, the softmax and the matmul with the values) is described here
as plain data, an :class:`AttentionRewrite`: which values are its queries, keys and values,
how each is transposed into the kernel's layout (``ir.attention_op``: ``[*batch, sequence,
features]``), the scale and whether it is causal. The loss forward then runs with every such
site's equations left out and ``attention_op.attention`` computing its result, and is
differentiated as a whole: its backward holds ``autopar_attention_bwd``, which recomputes
the probabilities, not the probabilities themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from autopar.ir.attention_op import attention
from autopar.ir.flatten import StepJaxpr, flatten_step
from autopar.ir.layered_grad import loss_forward, plain_expansion, value_and_grad_of
from autopar.ir.loss_markers import LossFunction
from autopar.ir.program import FlatProgram, run_eqns


@dataclass(frozen=True)
class AttentionRewrite:
    """One attention of a loss forward, as the kernel computes it. ``output_eqn``: the
    equation (the matmul with the values) whose result the kernel gives; ``eqns``: every
    equation of the site, left out; ``query_order`` etc.: the transpositions taking each
    operand into the kernel's layout, and ``result_order`` its output into the result's."""

    output_eqn: int
    eqns: frozenset[int]
    query: int
    key: int
    value: int
    result: int
    query_order: tuple[int, ...]
    key_order: tuple[int, ...]
    value_order: tuple[int, ...]
    result_order: tuple[int, ...]
    causal: bool
    scale: float
    # sizes of the query axes (after the shared leading ones) the keys and values are
    # broadcast to: grouped-query attention's query groups per key head
    groups: tuple[int, ...] = ()


# What the compiler gives: the rewritable attentions of a loss forward.
FindRewrites = Callable[[FlatProgram], Sequence[AttentionRewrite]]


def _needed(forward: FlatProgram, by_output: dict[int, AttentionRewrite]) -> list[int]:
    """The equations the rewritten forward runs, in order: those its results depend on once
    every site is the kernel (a causal mask's making, no longer read, is left out too)."""
    wanted = set(forward.out_ids)
    skipped = frozenset().union(*(r.eqns for r in by_output.values()))
    run: list[int] = []
    for eqn in reversed(forward.eqns):
        site = by_output.get(eqn.index)
        if site is not None:
            if site.result in wanted:
                run.append(eqn.index)
                wanted.update((site.query, site.key, site.value))
            continue
        if eqn.index in skipped or not wanted.intersection(eqn.outputs):
            continue
        run.append(eqn.index)
        wanted.update(eqn.inputs)
    return run[::-1]


def rewritten_forward(forward: FlatProgram, rewrites: Sequence[AttentionRewrite]
                      ) -> Callable[[list[Any]], list[Any]]:
    """``forward`` as a function of its input values, each of ``rewrites`` computed by the
    kernel."""
    by_output = {r.output_eqn: r for r in rewrites}
    order = _needed(forward, by_output)

    def value(env: dict[int, Any], vid: int) -> Any:
        return env[vid] if vid in env else forward.values[vid]

    def run(values: list[Any]) -> list[Any]:
        env = dict(zip(forward.in_ids, values, strict=True))
        for index in order:
            site = by_output.get(index)
            if site is None:
                run_eqns(forward, (index,), env)
                continue
            q = jnp.transpose(value(env, site.query), site.query_order)
            k = jnp.transpose(value(env, site.key), site.key_order)
            v = jnp.transpose(value(env, site.value), site.value_order)
            if site.groups:
                k, v = (_broadcast_groups(x, site.groups) for x in (k, v))
            out = attention(q, k, v, site.causal, site.scale)
            out = jnp.transpose(out, site.result_order)
            env[site.result] = out.astype(forward.avals[site.result].dtype)
        return [value(env, v) for v in forward.out_ids]

    return run


def _broadcast_groups(x: Any, groups: tuple[int, ...]) -> Any:
    """``x [*batch, S, D]`` as ``[*batch, *groups, S, D]``, the same for every group."""
    lead = x.ndim - 2
    axes = tuple(range(lead, lead + len(groups)))
    return jnp.broadcast_to(jnp.expand_dims(x, axes), (*x.shape[:lead], *groups, *x.shape[lead:]))


def attention_value_and_grad(loss: LossFunction, find: FindRewrites
                             ) -> Callable[..., list[Any]] | None:
    """[loss, *aux, *grads] like ``loss.value_and_grad``, with the attentions ``find``
    returns for the loss forward run by the kernel (None: it finds none, or the forward runs
    scan regions, which are not rewritten)."""
    forward = loss_forward(loss)
    if forward.regions:
        return None
    rewrites = find(forward)
    if not rewrites:
        return None
    return value_and_grad_of(loss, rewritten_forward(forward, rewrites))


def flatten_step_with_attention(fn: Callable, args: Sequence[Any], find: FindRewrites,
                                jaxpr: StepJaxpr | None = None) -> FlatProgram | None:
    """``flatten_step`` with ``autopar.value_and_grad`` inlined with its attentions rewritten
    (``attention_value_and_grad``); None where there is nothing to rewrite."""
    found: list[bool] = []

    def expand(loss: LossFunction) -> Callable[..., list[Any]]:
        expanded = attention_value_and_grad(loss, find)
        found.append(expanded is not None)
        return plain_expansion(loss) if expanded is None else expanded

    program = flatten_step(fn, args, expand_loss=expand, jaxpr=jaxpr)
    return program if any(found) else None
