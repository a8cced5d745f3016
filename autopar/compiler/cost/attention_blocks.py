"""What autopar's attention kernel (``ir.attention_op``) holds while it runs: its blocks of
scores.

The kernel keeps O(sequence) between the forward and the backward, but while one attention
runs a device holds a block of float32 scores per head and query row: ``[lead, rows, cols]``,
its local heads (and batch) by its local queries by the keys it meets at once (all of them
where the keys are whole, one device's slice on a ring; a zig-zag ring's later blocks are half
that, its own block is the largest). The forward holds the scores and their exponentials,
the backward the probabilities, their gradient and the scores' gradient: two and three
blocks. They live only while the node runs, so the memory model counts them as the node's
transient bytes (``memory_model.estimate_memory``'s ``resharded``: alive while the node
runs), not between nodes; the ILP's memory rows, which sample tensors alive between nodes,
leave them out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from autopar.compiler.cost.memory_model import resharded_operand_bytes
from autopar.compiler.graph.opgraph import OpGraph
from autopar.ir.attention_op import BACKWARD_NAME, FORWARD_NAME
from autopar.plan import ShardingSpec

SCORE_BYTES = 4  # the kernel's scores are float32 whatever the operands' dtype
BLOCKS = {FORWARD_NAME: 2, BACKWARD_NAME: 3}


def attention_block_bytes(graph: OpGraph, input_specs: Mapping[int, tuple[Any, ...]],
                          sizes: Mapping[str, int]) -> dict[int, float]:
    """Per attention node of ``graph``, the per-device bytes of its score blocks, its query
    and key operands laid out as ``input_specs[node]`` says (a plan's per-node operand
    specs: a strategy's ``input_specs``; a node missing there reads them whole) on a mesh of
    ``sizes`` (axis -> size)."""
    out: dict[int, float] = {}
    for node in graph.nodes:
        blocks = BLOCKS.get(node.primitive)
        if blocks is None:
            continue
        q, k = (graph.tensors[t] for t in node.inputs[:2])
        specs = input_specs.get(node.id, ())
        q_spec = specs[0] if specs and specs[0] is not None else None
        k_spec = specs[1] if len(specs) > 1 and specs[1] is not None else None
        lead = math.prod(q.shape[:-2]) / _ways(q_spec, range(len(q.shape) - 2), sizes)
        rows = q.shape[-2] / _ways(q_spec, (len(q.shape) - 2,), sizes)
        cols = k.shape[-2] / _ways(k_spec, (len(k.shape) - 2,), sizes)
        out[node.id] = float(blocks * lead * rows * cols * SCORE_BYTES)
    return out


def transient_bytes(graph: OpGraph, node_strategy: Mapping[int, Any],
                    operand_specs: Mapping[tuple[int, int], ShardingSpec],
                    shards: Mapping[int, int], sizes: Mapping[str, int],
                    copies: bool = True) -> dict[int, float]:
    """Per node of a one-stage plan, the bytes alive only while it runs
    (``estimate_memory``'s ``resharded``): the operand copies it reads in another layout than
    their producer's (``resharded_operand_bytes``; left out with ``copies=False``) and an
    attention kernel's score blocks. ``node_strategy``: each node's chosen strategy (its
    ``input_specs``), ``operand_specs``: the plan's per-use specs, ``shards``: how many ways
    each tensor is split."""
    out = resharded_operand_bytes(
        graph, {use: spec.num_shards(dict(sizes)) for use, spec in operand_specs.items()},
        shards) if copies else {}
    blocks = attention_block_bytes(
        graph, {n: s.input_specs for n, s in node_strategy.items()}, sizes)
    for n, size in blocks.items():
        out[n] = out.get(n, 0.0) + size
    return out


def _ways(spec: ShardingSpec | None, dims: Any, sizes: Mapping[str, int]) -> int:
    """How many ways ``spec`` splits the dimensions ``dims`` together (1: whole)."""
    if spec is None:
        return 1
    return math.prod(sizes.get(a, 1) for d in dims for a in spec.dims[d])
