"""The attention kernel's strategies (``strategies.attention``) on the zoo GPT rewritten for it:
the leading axes split freely; the sequence split over one mesh axis with the keys whole
(their gradients then all-reduced) or as ring attention, whose collective-permutes are one
per step (n - 1 forward, 2n - 1 backward) and count on the step only beyond the compute they
run beside. The GPT is causal: its ring runs zig-zag, computing ``(n + 1) / 2n`` of the
blocks, after one exchange of its operands' halves and before one of its results'."""

from __future__ import annotations

from functools import cache

import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.attention_forms import trace_with_attention_kernel
from autopar.compiler.intra_op.strategies import StrategyContext, strategies_for
from autopar.compiler.intra_op.strategies.attention import GATHER, RING
from autopar.ir.attention_op import zigzag_share
from autopar.models import get_model
from autopar.plan import CollectiveKind

SEQ = 64


@cache
def traced():
    model = get_model("gpt", "tiny", seq_len=SEQ).with_value_and_grad(autopar.value_and_grad)
    found = trace_with_attention_kernel(model.train_step, model.abstract_inputs())
    assert found is not None
    return found


def strategies(primitive: str, shape: tuple[int, int]):
    graph = traced().graph
    node = next(n for n in graph.nodes if n.primitive == primitive)
    mesh = LogicalMesh.from_cluster(load_cluster("a100-80gb-x8"), shape)
    return mesh, strategies_for(StrategyContext(node, graph, mesh))


@pytest.mark.parametrize("primitive, sends", [("autopar_attention", 1),
                                              ("autopar_attention_bwd", 2)])
def test_ring_and_gathered_keys_on_each_axis(primitive, sends):
    mesh, found = strategies(primitive, (2, 4))
    by_name = {s.name: s for s in found}
    for axis, n in zip(mesh.axis_names, mesh.shape, strict=True):
        ring = next(s for name, s in by_name.items() if name.endswith(RING)
                    and s.input_specs[1].dims[-2] == (axis,) and not any(
                        s.input_specs[0].dims[:-2]))
        # queries, keys and values split alike along the sequence
        assert ring.input_specs[0].dims[-2] == ring.input_specs[2].dims[-2] == (axis,)
        permutes = [c for c in ring.collectives if c.kind == CollectiveKind.COLLECTIVE_PERMUTE]
        assert len(permutes) == len(ring.collectives) == sends + 2
        *steps, into, out_of = permutes
        assert sum(c.count for c in steps) == (n - 1 if sends == 1 else 2 * n - 1)
        # the zig-zag exchanges, of every operand's slice and every result's, are exposed
        assert into.count == out_of.count == 1 and into.nbytes > 0 and out_of.nbytes > 0
        total = sum(c.time_s for c in steps)
        assert ring.communication_time_s == pytest.approx(
            into.time_s + out_of.time_s + max(0.0, total - ring.compute_time_s))
        gather = next(s for name, s in by_name.items() if name.endswith(GATHER)
                      and s.input_specs[0].dims[-2] == (axis,) and not any(
                          s.input_specs[0].dims[:-2]))
        assert gather.input_specs[1].dims[-2] == ()  # the keys arrive whole
        reduces = [c.kind for c in gather.collectives]
        assert reduces == ([CollectiveKind.ALL_REDUCE] if sends == 2 else [])
        # either way the work divides over the axis; the causal ring skips its masked halves
        whole = next(s for s in found if not any(d for spec in s.input_specs for d in spec.dims))
        assert gather.compute_time_s == pytest.approx(whole.compute_time_s / n, rel=0.05)
        assert ring.compute_time_s == pytest.approx(
            whole.compute_time_s / n * zigzag_share(n), rel=0.05)


def test_the_batch_and_heads_split_without_communication():
    _, found = strategies("autopar_attention", (2, 4))
    lead = [s for s in found if not s.name.endswith((RING, GATHER))
            and any(s.input_specs[0].dims[:-2])]
    assert lead and all(not s.collectives and s.communication_time_s == 0 for s in lead)


def test_the_kernels_score_blocks_are_counted_while_it_runs():
    """``cost.attention_blocks``: per attention node, the float32 score blocks one device
    holds while it runs (two forward, three backward): the local heads by the local queries
    by the keys met at once, whole, gathered or one ring slice."""
    from autopar.compiler.cost.attention_blocks import attention_block_bytes

    graph = traced().graph
    mesh, found = strategies("autopar_attention", (2, 4))
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    node = next(n for n in graph.nodes if n.primitive == "autopar_attention")
    q = graph.tensors[node.inputs[0]]
    lead = 1
    for d in q.shape[:-2]:
        lead *= d
    whole = attention_block_bytes(graph, {}, sizes)[node.id]
    assert whole == 2 * lead * SEQ * SEQ * 4
    x = mesh.axis_names[1]
    for s in found:
        if s.input_specs[0].dims[-2] != (x,) or any(s.input_specs[0].dims[:-2]):
            continue
        got = attention_block_bytes(graph, {node.id: s.input_specs}, sizes)[node.id]
        cols = SEQ // 4 if s.name.endswith(RING) else SEQ
        assert got == 2 * lead * (SEQ // 4) * cols * 4, s.name
    backward = next(n for n in graph.nodes if n.primitive == "autopar_attention_bwd")
    assert attention_block_bytes(graph, {}, sizes)[backward.id] == 3 * lead * SEQ * SEQ * 4
