"""Which attentions of a loss forward the kernel can compute, and how (``ir.attention_rewrite``).

A found attention (``graph.attention``) is rewritten when everything between its two matmuls is
what the kernel computes: one contracted feature axis and one sequence axis per operand, any
number of shared leading axes (batch, heads), and query axes the keys and values are shared
across (grouped-query attention's groups: the keys and values are broadcast to them); between
the scores and the softmax only a positive scale (a multiplication or division by a scalar
constant), casts between float types, and at most one mask, which must be the causal one
(``attention_mask``) filling with a large negative constant; and none of its intermediate
values (the scores, the probabilities) read by anything else. Anything else stays as the model
wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autopar.compiler.graph.attention import AttentionSite, find_attention
from autopar.compiler.graph.attention_mask import is_causal
from autopar.compiler.graph.opgraph import OpGraph, OpNode
from autopar.compiler.graph.trace import TracedStep, build_graph
from autopar.ir.attention_rewrite import AttentionRewrite, flatten_step_with_attention
from autopar.ir.flatten import StepJaxpr
from autopar.ir.program import FlatProgram

# A mask's fill at or below this is minus infinity to a float32 softmax (exp underflows).
MASK_FILL_AT_MOST = -1e9


def attention_rewrites(program: FlatProgram) -> list[AttentionRewrite]:
    """The attentions of ``program`` (a loss forward) the kernel can compute, in order."""
    graph = build_graph(program)
    found = (_rewrite(graph, program, site) for site in find_attention(graph))
    return [r for r in found if r is not None]


def trace_with_attention_kernel(fn: Callable, args: Sequence[Any],
                                jaxpr: StepJaxpr | None = None) -> TracedStep | None:
    """The step traced with its loss function's rewritable attentions run by the kernel
    (``ir.attention_rewrite``); None where it has none (or no ``autopar.value_and_grad``)."""
    program = flatten_step_with_attention(fn, tuple(args), attention_rewrites, jaxpr=jaxpr)
    return None if program is None else TracedStep(program, build_graph(program))


def _free(ndim: int, *used: Any) -> list[int]:
    taken = {d for dims in used for d in dims}
    return [d for d in range(ndim) if d not in taken]


def _rewrite(graph: OpGraph, program: FlatProgram,
             site: AttentionSite) -> AttentionRewrite | None:
    chain = _chain(graph, program, site)
    if chain is None or _read_outside(graph, site):
        return None
    scale, causal, permutations = chain
    scores = graph.nodes[site.scores]
    contracts, batches = scores.params["dimension_numbers"]
    if len(contracts[0]) != 1:
        return None
    # where each axis of the scores comes from: (lhs axis, rhs axis), None where it is not
    # the operand's: the batch axes, then the lhs's free axes, then the rhs's
    ndims = [graph.tensors[t].ndim for t in scores.inputs]
    origins: list[tuple[int | None, int | None]] = list(zip(*batches, strict=True))
    origins += [(d, None) for d in _free(ndims[0], contracts[0], batches[0])]
    origins += [(None, d) for d in _free(ndims[1], contracts[1], batches[1])]
    for permutation in permutations:
        origins = [origins[p] for p in permutation]
    # the softmax's axis (the last) is the keys' sequence: that operand holds the keys
    k_side = 0 if origins[-1][0] is not None else 1
    q_side = 1 - k_side
    batch = len(batches[0])
    if any(None in o for o in origins[:batch]) or any(
            o[q_side] is None for o in origins[batch:-1]):
        return None
    query, key = scores.inputs[q_side], scores.inputs[k_side]
    q_axes = [int(o[q_side]) for o in origins[:-1]]  # type: ignore[arg-type]  # checked above
    k_axes = [int(o[k_side]) for o in (*origins[:batch], origins[-1])]  # type: ignore[arg-type]
    query_order = (*q_axes, contracts[q_side][0])
    key_order = (*k_axes, contracts[k_side][0])
    groups = tuple(graph.tensors[query].shape[a] for a in q_axes[batch:-1])
    value = _value_layout(graph, site, len(origins), batch)
    if value is None or (causal and site.query_length != site.key_length):
        return None
    value_order, result_order = value
    return AttentionRewrite(
        output_eqn=site.output, eqns=frozenset(site.nodes), query=query, key=key,
        value=site.value, result=site.result, query_order=query_order, key_order=key_order,
        value_order=value_order, result_order=result_order, causal=causal, scale=scale,
        groups=groups)


def _value_layout(graph: OpGraph, site: AttentionSite, ndim: int,
                  batch: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """How the values go into the kernel's layout and its output into the result's, from the
    output matmul (the probabilities have the scores' layout: batch, groups, queries, keys)."""
    contract, batches = graph.nodes[site.output].params["dimension_numbers"]
    side = site.probabilities_side
    if tuple(batches[side]) != tuple(range(batch)) or tuple(contract[side]) != (ndim - 1,):
        return None
    v_contract, v_batch = contract[1 - side], batches[1 - side]
    v_free = _free(graph.tensors[site.value].ndim, v_contract, v_batch)
    if len(v_free) != 1:
        return None
    # the kernel gives [*batch, *groups, queries, features]; the matmul's result is [*batch,
    # lhs free, rhs free]: the same where the probabilities are the lhs
    result_order = tuple(range(ndim)) if side == 0 else (
        *range(batch), ndim - 1, *range(batch, ndim - 1))
    return (*v_batch, v_contract[0], v_free[0]), result_order


def _read_outside(graph: OpGraph, site: AttentionSite) -> bool:
    """Whether a value the site makes, other than its result, is read outside it."""
    inside = set(site.nodes)
    made = {t for n in site.nodes if n != site.output for t in graph.nodes[n].outputs}
    return any(io.tensor in made for io in graph.outputs) or any(
        c not in inside for t in made for c in graph.consumers.get(t, ()))


def _constant(graph: OpGraph, program: FlatProgram, tensor: int) -> float | None:
    """The value of a scalar constant, or of a scalar constant broadcast or cast."""
    for _ in range(4):
        value = program.values.get(tensor)
        if value is not None:
            return float(np.asarray(value).reshape(-1)[0]) if np.size(value) == 1 else None
        at = graph.producer.get(tensor)
        if at is None or graph.nodes[at].primitive not in ("broadcast_in_dim",
                                                           "convert_element_type"):
            return None
        tensor = graph.nodes[at].inputs[0]
    return None


def _chain(graph: OpGraph, program: FlatProgram,
           site: AttentionSite) -> tuple[float, bool, list[tuple[int, ...]]] | None:
    """The scale, whether the site is causal, and the transpositions (in program order)
    between the scores and the softmax, read off its chain; None where the chain does
    anything else (or transposes the scores after masking them)."""
    data = {t for n in (site.scores, *site.chain) for t in graph.nodes[n].outputs}
    scale, causal = 1.0, False
    permutations: list[tuple[int, ...]] = []
    for n in reversed(site.chain):  # program order
        node = graph.nodes[n]
        operands = [k for k, t in enumerate(node.inputs) if t in data]
        if len(operands) != 1:
            return None
        if node.primitive == "transpose":
            if causal:
                return None
            permutations.append(tuple(node.params["permutation"]))
            continue
        step = _step(graph, program, node, operands[0])
        if step is None or (step[1] and causal):
            return None
        scale *= step[0]
        causal = causal or step[1]
    return (scale, causal, permutations) if scale > 0 else None


def _step(graph: OpGraph, program: FlatProgram, node: OpNode,
          position: int) -> tuple[float, bool] | None:
    """(factor, masks) of one chain node whose operand ``position`` is the scores."""
    other = node.inputs[1 - position] if len(node.inputs) == 2 else None
    if node.primitive == "convert_element_type":
        return (1.0, False) if np.dtype(node.params["new_dtype"]).kind == "f" else None
    if node.primitive == "mul" and other is not None:
        c = _constant(graph, program, other)
        return None if c is None else (c, False)
    if node.primitive == "div" and position == 0 and other is not None:
        c = _constant(graph, program, other)
        return None if not c else (1.0 / c, False)
    if node.primitive == "select_n" and len(node.inputs) == 3 and position > 0:
        fill = _constant(graph, program, node.inputs[3 - position])
        if fill is None or fill > MASK_FILL_AT_MOST:
            return None
        pred = node.inputs[0]
        # the scores are kept where the predicate is True (case 1) or False (case 0)
        keeps_when_true = position == 2
        if keeps_when_true and is_causal(graph, program, pred):
            return (1.0, True)
        return None
    return None
