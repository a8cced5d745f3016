"""Strategies for autopar's attention primitives (``ir.attention_op``): the forward ``q, k, v
-> out, lse`` and the backward ``q, k, v, out, lse, d_out -> dq, dk, dv``, every tensor laid
out ``[*lead, sequence, features]`` (``lse`` without the features).

* **Leading axes** (batch, heads, query groups) split alike on every tensor: each device
  attends its own rows, no communication.
* **Queries split, keys and values whole** over a mesh axis (``gather``): each device
  attends its slice of the queries to every key. The keys and values reach it whole (an
  all-gather on the edge, priced there, where the producer left them split); the backward's
  key and value gradients are partial sums over the axis (an all-reduce).
* **Context parallelism** (``ring``): queries, keys and values split along the sequence over
  one mesh axis of ``n`` devices, run as ring attention (``runtime.ring_attention``): ``n - 1``
  steps pass each device's key and value block to the next device (collective-permutes),
  and the backward passes the key and value gradients along with them (``n`` more). A
  step's send runs beside the previous block's compute, so only what the sends take beyond
  the compute is on the step's critical path (the whole of them is listed as the strategy's
  collectives, for reports).

The kernel computes every block of scores on one device, masked or not
(``graph.op_costs.attention_flops``). A causal ring whose slices have an even length runs
zig-zag (``runtime.ring_attention``): each device computes its own block and half of each
other one (``ir.attention_op.zigzag_share`` of the flops, evenly), after its operands' halves
are exchanged into zig-zag order and before its results' are exchanged back, two
collective-permutes of half a slice per tensor, on the critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from autopar.compiler.graph.opgraph import OpGraph, OpNode
from autopar.compiler.intra_op.strategies.base import Strategy, StrategyContext, specs_on_mesh
from autopar.compiler.intra_op.strategies.compute_common import finalize
from autopar.compiler.intra_op.strategies.data_common import spec_axes, spec_name
from autopar.ir.attention_op import (
    BACKWARD_NAME,
    FORWARD_NAME,
    zigzag_applies,
    zigzag_share,
)
from autopar.plan import CollectiveEstimate, CollectiveKind, ShardingSpec, StagePlan

GATHER = "gather"
RING = "ring"


def _spec(lead: ShardingSpec, *rest: tuple[str, ...]) -> ShardingSpec:
    return ShardingSpec((*lead.dims, *rest))


def _layouts(ctx: StrategyContext) -> list[tuple[ShardingSpec, str, tuple[str, ...]]]:
    """(leading axes' spec, sequence mode, the sequence's mesh axes) of every strategy."""
    q, k = ctx.inputs[0], ctx.inputs[1]
    sq, sk = q.shape[-2], k.shape[-2]
    found: list[tuple[ShardingSpec, str, tuple[str, ...]]] = []
    for lead in specs_on_mesh(q.shape[:-2], ctx.mesh):
        found.append((lead, "whole", ()))
        used = set(spec_axes(lead))
        for axis in ctx.axis_names:
            n = ctx.axis_size(axis)
            if axis in used or n == 1 or sq % n:
                continue
            found.append((lead, GATHER, (axis,)))
            if sk % n == 0:
                found.append((lead, RING, (axis,)))
    return found


def _ring_sends(ctx: StrategyContext, sequence: tuple[str, ...], lead: ShardingSpec,
                tensors: Sequence[int], steps: int) -> CollectiveEstimate:
    """``steps`` collective-permutes, each of one device's blocks of the operands
    ``tensors``."""
    block = sum(_per_device(ctx, ctx.inputs[t].nbytes, lead) for t in tensors) / ctx.axes_size(
        sequence)
    one = ctx.collective(CollectiveKind.COLLECTIVE_PERMUTE, block, sequence)
    return replace(one, count=steps, time_s=steps * one.time_s)


def _outputs_sent(ctx: StrategyContext, sequence: tuple[str, ...],
                  lead: ShardingSpec) -> CollectiveEstimate:
    """One device's slices of every output, sent once (by two collective-permutes of half a
    slice each: priced as one of the whole)."""
    block = sum(_per_device(ctx, t.nbytes, lead) for t in ctx.outputs) / ctx.axes_size(sequence)
    return ctx.collective(CollectiveKind.COLLECTIVE_PERMUTE, block, sequence)


def _per_device(ctx: StrategyContext, nbytes: float, lead: ShardingSpec) -> float:
    return nbytes / lead.num_shards({a: ctx.axis_size(a) for a in ctx.axis_names})


def _strategy(ctx: StrategyContext, lead: ShardingSpec, mode: str, sequence: tuple[str, ...],
              backward: bool) -> Strategy:
    q_seq = sequence
    kv_seq = sequence if mode == RING else ()
    q_spec, kv_spec = _spec(lead, q_seq, ()), _spec(lead, kv_seq, ())
    lse_spec = _spec(lead, q_seq)
    flops = ctx.node.flops
    collectives: list[CollectiveEstimate] = []
    relayout: list[CollectiveEstimate] = []
    if mode == RING:
        n = ctx.axis_size(sequence[0])
        if zigzag_applies(bool(ctx.node.params.get("causal")), n, ctx.inputs[0].shape[-2] // n):
            flops *= zigzag_share(n)
            # every operand's halves into zig-zag order, every result's back: one slice each
            relayout = [_ring_sends(ctx, sequence, lead, range(len(ctx.inputs)), 1),
                        _outputs_sent(ctx, sequence, lead)]
    compute = ctx.compute_time(flops, (*spec_axes(lead), *sequence))
    exposed = sum(c.time_s for c in relayout)
    if mode == RING:
        # forward: k and v go round (n - 1 steps); backward: k, v (n - 1) and dk, dv (n)
        sends = [_ring_sends(ctx, sequence, lead, (1, 2), n - 1)]
        if backward:
            sends.append(_ring_sends(ctx, sequence, lead, (1, 2), n))
        collectives += sends + relayout
        exposed += max(0.0, sum(c.time_s for c in sends) - compute)
    elif mode == GATHER and backward:
        # each device's dk, dv are its queries' share: summed over the axis
        nbytes = sum(_per_device(ctx, ctx.outputs[t].nbytes, lead) for t in (1, 2))
        collectives.append(ctx.collective(CollectiveKind.ALL_REDUCE, nbytes, sequence))
        exposed = collectives[-1].time_s
    inputs: tuple[ShardingSpec, ...] = (q_spec, kv_spec, kv_spec)
    outputs: tuple[ShardingSpec, ...] = (q_spec, lse_spec)
    if backward:
        inputs, outputs = (*inputs, q_spec, lse_spec, q_spec), (q_spec, kv_spec, kv_spec)
    name = spec_name(_spec(lead, q_seq, ())) + ("" if mode == "whole" else f" {mode}")
    return Strategy(name, outputs, inputs, compute, exposed, tuple(collectives))


def attention_strategies(ctx: StrategyContext, backward: bool) -> list[Strategy]:
    """Every layout of ``_layouts`` as a strategy of the forward or the backward."""
    return finalize(ctx, [_strategy(ctx, lead, mode, sequence, backward)
                          for lead, mode, sequence in _layouts(ctx)])


RULES: dict[str, Callable[[StrategyContext], list[Strategy]]] = {
    FORWARD_NAME: lambda ctx: attention_strategies(ctx, backward=False),
    BACKWARD_NAME: lambda ctx: attention_strategies(ctx, backward=True),
}


def attention_nodes(graph: OpGraph) -> list[OpNode]:
    """The graph's attention kernels (forward)."""
    return [node for node in graph.nodes if node.primitive == FORWARD_NAME]


def sequence_splits(graph: OpGraph, stage: StagePlan) -> dict[str, int]:
    """How many of the graph's attention kernels ``stage`` runs with the sequence split: as
    ring attention (the keys split too: ``RING``) or with the queries split and the keys and
    values gathered (``GATHER``, Llama 3's form of context parallelism)."""
    def spec(node: OpNode, position: int) -> ShardingSpec | None:
        found = stage.operand_shardings.get((node.id, position))
        return found or stage.tensor_shardings.get(node.inputs[position])

    counts = {RING: 0, GATHER: 0}
    for node in attention_nodes(graph):
        query, key = spec(node, 0), spec(node, 1)
        if key is not None and key.dims[-2]:
            counts[RING] += 1
        elif query is not None and query.dims[-2]:
            counts[GATHER] += 1
    return counts
