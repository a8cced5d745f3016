"""Layer clustering: hand-solvable graphs, brute force on random graphs, the zoo GPT forward."""

import itertools
import json
import math
import random

import numpy as np
import pytest

from autopar.compiler.graph.opgraph import GraphIO, OpGraph, OpNode, TensorInfo
from autopar.compiler.graph.trace import trace_step
from autopar.compiler.inter_op.layers import cluster_layers, layers_from_boundaries
from autopar.errors import PlanError
from autopar.models import get_model


def make_graph(ops, input_bytes=(), output=None):
    """A graph from ``ops = [(flops, input tensor ids, {output id: nbytes})]`` in program order.

    Tensors ``0 .. len(input_bytes)-1`` are graph inputs; sizes are given in bytes as uint8
    vectors so that ``nbytes`` is exactly the number written.
    """
    tensors = {
        t: TensorInfo(t, (nbytes,), "uint8", "input") for t, nbytes in enumerate(input_bytes)
    }
    nodes = []
    for pos, (flops, inputs, outputs) in enumerate(ops):
        for t, nbytes in outputs.items():
            tensors[t] = TensorInfo(t, (nbytes,), "uint8", "intermediate")
        nodes.append(OpNode(100 + pos, "op", tuple(inputs), tuple(outputs), float(flops), 0.0))
    last = output if output is not None else max(tensors)
    return OpGraph(
        nodes=nodes,
        tensors=tensors,
        inputs=[GraphIO(t, f"in{t}", 0) for t in range(len(input_bytes))],
        outputs=[GraphIO(last, "out")],
    )


def live_bytes(graph, position):
    """Bytes of tensors made before node ``position`` and read at or after it, the slow way."""
    order = {node.id: pos for pos, node in enumerate(graph.nodes)}
    made = {t: order[n.id] for n in graph.nodes for t in n.outputs}
    total = 0
    for t, at in made.items():
        readers = [order[n.id] for n in graph.nodes if t in n.inputs]
        if at < position and any(r >= position for r in readers):
            total += graph.tensors[t].nbytes
    return total


def objective(graph, positions):
    cuts = [live_bytes(graph, p) for p in positions]
    edges = (0, *positions, len(graph.nodes))
    flops = [sum(n.flops for n in graph.nodes[a:b]) for a, b in itertools.pairwise(edges)]
    return max(cuts, default=0), sum(cuts), sum(f * f for f in flops)


def chain(flops, act_bytes, extra_inputs=None):
    """Node i reads tensor i (node 0 reads graph input 0) and writes tensor i+1."""
    extra_inputs = extra_inputs or {}
    ops = [(f, (i, *extra_inputs.get(i, ())), {i + 1: act_bytes[i]}) for i, f in enumerate(flops)]
    return ops


def test_thin_tensor_between_heavy_halves_is_the_cut():
    # 8 nodes of 10 flops; node 4 writes a 4-byte tensor, every other activation is 1000 bytes.
    # Two layers, tolerance 0.25 -> each layer in [30, 50] flops -> cut before node 3, 4 or 5;
    # only the cut before node 5 carries the thin tensor alone, so it is optimal.
    sizes = [1000, 1000, 1000, 1000, 4, 1000, 1000, 1000]
    graph = make_graph(chain([10] * 8, sizes), input_bytes=(64,))
    result = cluster_layers(graph, 2)
    assert result.positions == (5,)
    assert result.cut_bytes == (4,) == (live_bytes(graph, 5),)
    assert result.flops == (50.0, 30.0)
    assert result.layers == (tuple(range(100, 105)), tuple(range(105, 108)))
    assert result.tolerance_used == 0.25 and not result.relaxed
    # A tight tolerance (band [36, 44]) leaves only the balanced cut, thick as it is.
    tight = cluster_layers(graph, 2, balance_tolerance=0.1)
    assert tight.positions == (4,) and tight.cut_bytes == (1000,)


def test_zero_flop_nodes_join_the_side_with_the_cheaper_cut():
    # Node 3 (zero flops) broadcasts a graph input for node 4; cutting after it would also carry
    # its 500-byte output, so the cut goes before it and it joins the layer that reads it.
    ops = [
        (10, (0,), {2: 8}),
        (10, (2,), {3: 8}),
        (10, (3,), {4: 8}),
        (0, (1,), {5: 500}),
        (10, (4, 5), {6: 8}),
        (20, (6,), {7: 8}),
    ]
    graph = make_graph(ops, input_bytes=(8, 8))
    # Band [15, 45]: cuts at 2, 3, 4 and 5 fit and all but 4 cost 8 bytes; 30/30 flops is the
    # most balanced, and of that gap's two positions (3, 4) the one before node 3 is cheaper.
    result = cluster_layers(graph, 2, balance_tolerance=0.5)
    assert result.positions == (3,) and result.flops == (30.0, 30.0)
    assert result.cut_bytes == (8,) == (live_bytes(graph, 3),)
    assert live_bytes(graph, 4) == 508


def test_long_skip_tensor_is_counted_once_per_cut_it_crosses():
    # Chain of 8 nodes (10 flops, 100-byte activations) plus a 1000-byte skip tensor written by
    # node 0 and read by nodes 3 and 5: it crosses every cut at positions 1..5.
    sizes = [100] * 8
    ops = chain([10] * 8, sizes, extra_inputs={3: (50,), 5: (50,)})
    ops[0] = (10, (0,), {1: 100, 50: 1000})
    graph = make_graph(ops, input_bytes=(16,), output=8)
    # 4 layers of exactly 20 flops: cuts 2, 4, 6; the skip crosses the first two.
    four = cluster_layers(graph, 4)
    assert four.positions == (2, 4, 6)
    assert four.cut_bytes == (1100, 1100, 100)
    assert four.cut_bytes == tuple(live_bytes(graph, p) for p in four.positions)
    # 3 layers in [20, 33.3] flops: the first cut (2 or 3) must cross the skip, the second
    # (5 or 6) need not -- only 6 avoids it, and then only 3 leaves a legal last layer.
    three = cluster_layers(graph, 3)
    assert three.positions == (3, 6)
    assert three.cut_bytes == (1100, 100)
    assert three.max_cut_bytes == 1100


def test_infeasible_tolerance_is_relaxed_and_recorded():
    graph = make_graph(chain([100, 1, 1, 1], [8, 8, 8, 8]), input_bytes=(8,))
    # average 51.5: node 0 alone exceeds 1.25x and 1.5x the average; tolerance 1.0 fits.
    result = cluster_layers(graph, 2)
    assert result.tolerance_used == 1.0 and result.balance_tolerance == 0.25 and result.relaxed
    assert result.positions == (1,) and result.flops == (100.0, 3.0)


def test_errors_name_the_numbers():
    graph = make_graph(chain([10, 0, 10, 0], [8, 8, 8, 8]), input_bytes=(8,))
    with pytest.raises(PlanError, match=r"3 layers .* 2 flop-bearing nodes \(of 4 nodes\)"):
        cluster_layers(graph, 3)
    with pytest.raises(PlanError, match="at least 1, got 0"):
        cluster_layers(graph, 0)
    with pytest.raises(PlanError, match="position 4 .* 1..3"):
        layers_from_boundaries(graph, (2, 4))
    with pytest.raises(PlanError, match=r"\[2, 2\] must be strictly increasing"):
        layers_from_boundaries(graph, (2, 2))
    one = cluster_layers(graph, 1)
    assert one.layers == ((100, 101, 102, 103),) and one.cut_bytes == ()


def test_layers_from_boundaries_and_to_dict():
    ops = chain([5, 6, 7, 8, 9], [10, 20, 30, 40, 50], extra_inputs={4: (1,)})
    graph = make_graph(ops, input_bytes=(4,))
    result = layers_from_boundaries(graph, (1, 3))
    assert result.layers == ((100,), (101, 102), (103, 104))
    assert result.flops == (5.0, 13.0, 17.0)
    # tensor 1 (10 bytes) is read again by node 4, so it crosses both cuts
    assert result.cut_bytes == (10, 10 + 30) == (live_bytes(graph, 1), live_bytes(graph, 3))
    assert result.tolerance_used is None
    data = json.loads(json.dumps(result.to_dict()))
    assert data["layers"] == [[100], [101, 102], [103, 104]] and data["num_layers"] == 3


def random_graph(rng, num_nodes):
    ops = []
    tensors = [0, 1]  # graph inputs
    for i in range(num_nodes):
        reads = rng.sample(tensors, k=min(len(tensors), rng.randint(1, 2)))
        out = 2 + i
        ops.append((rng.choice([0, 0, 1, 3, 5, 8, 13]), tuple(reads), {out: rng.randint(1, 50)}))
        tensors.append(out)
    return make_graph(ops, input_bytes=(7, 9))


def brute_force(graph, num_layers, tolerance):
    """Best (max cut, sum, sum of squared flops) over every cutting, relaxing as the spec says."""
    n = len(graph.nodes)
    flops = [node.flops for node in graph.nodes]
    average = sum(flops) / num_layers
    while True:
        best = None
        for positions in itertools.combinations(range(1, n), num_layers - 1):
            edges = (0, *positions, n)
            layer_flops = [sum(flops[a:b]) for a, b in itertools.pairwise(edges)]
            if any(not any(f > 0 for f in flops[a:b]) for a, b in itertools.pairwise(edges)):
                continue
            low, high = (1 - tolerance) * average, (1 + tolerance) * average
            if all(low - 1e-9 <= f <= high + 1e-9 for f in layer_flops):
                key = objective(graph, positions)
                best = key if best is None else min(best, key)
        if best is not None:
            return best, tolerance
        tolerance = 2 * tolerance


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_graphs(seed):
    rng = random.Random(seed)
    graph = random_graph(rng, rng.randint(4, 12))
    heavy = sum(node.flops > 0 for node in graph.nodes)
    if heavy == 0:
        return
    num_layers = rng.randint(1, min(4, heavy))
    tolerance = rng.choice([0.1, 0.25, 0.5])
    result = cluster_layers(graph, num_layers, balance_tolerance=tolerance)
    expected, expected_tolerance = brute_force(graph, num_layers, tolerance)
    assert result.tolerance_used == expected_tolerance
    assert objective(graph, result.positions) == expected
    assert result.cut_bytes == tuple(live_bytes(graph, p) for p in result.positions)
    assert len(result.layers) == num_layers
    assert [i for layer in result.layers for i in layer] == [n.id for n in graph.nodes]


def gpt_forward(num_layers):
    model = get_model("gpt", "tiny", num_layers=num_layers)
    state, batch = model.abstract_inputs()
    return model.config, trace_step(model.loss_fn, (state["params"], batch)).graph


def test_gpt_forward_layers_are_balanced_and_cut_on_the_residual_stream():
    num_layers = 3
    cfg, graph = gpt_forward(num_layers)
    result = cluster_layers(graph, num_layers)
    average = sum(result.flops) / num_layers
    assert result.tolerance_used == 0.25
    assert all(abs(f / average - 1) <= 0.25 for f in result.flops)
    assert math.isclose(sum(result.flops), graph.total_flops)
    residual = cfg.batch_size * cfg.seq_len * cfg.hidden_size * 4
    order = {node.id: pos for pos, node in enumerate(graph.nodes)}
    for position, nbytes in zip(result.positions, result.cut_bytes, strict=True):
        # live set across the cut, computed from producers/consumers directly
        live = [
            t
            for t, producer in graph.producer.items()
            if order[producer] < position and any(order[c] >= position for c in graph.consumers[t])
        ]
        assert nbytes == graph.bytes_of(live)
        # the cheapest cut in a GPT is between blocks: only the residual stream is live
        assert [graph.tensors[t].shape for t in live] == [
            (cfg.batch_size, cfg.seq_len, cfg.hidden_size)
        ]
        assert nbytes == residual
    # identical blocks: the cuts fall at the same place in each
    assert len(set(np.diff(result.positions))) == 1


def test_gpt_48_layers_is_fast():
    _, graph = gpt_forward(48)
    # how long clustering takes belongs to the planning-time benchmark (docs/benchmarks)
    result = cluster_layers(graph, 48)
    assert result.num_layers == 48
    average = sum(result.flops) / 48
    assert all(abs(f / average - 1) <= result.tolerance_used + 1e-9 for f in result.flops)
    assert result.cut_bytes == tuple(live_bytes_fast(graph, p) for p in result.positions)


def live_bytes_fast(graph, position):
    """``live_bytes`` with precomputed positions (the 48-layer graph has ~4000 nodes)."""
    order = {node.id: pos for pos, node in enumerate(graph.nodes)}
    return sum(
        graph.tensors[t].nbytes
        for t, producer in graph.producer.items()
        if order[producer] < position and any(order[c] >= position for c in graph.consumers[t])
    )


def test_one_stage_recomputation_checkpoints_every_repeated_block():
    """A one-stage plan's recomputed layers (``remat_layer_positions``) are at most
    ``DEFAULT_MAX_LAYERS`` clustered layers, each of several transformer blocks at 24 blocks;
    the checkpoints fall on every block boundary too, as pipeline stages' do, so that a
    backward rebuilds one block at a time."""
    import autopar
    from autopar.compiler.graph.trace import build_graph
    from autopar.compiler.inter_op.layers import DEFAULT_MAX_LAYERS, remat_layer_positions
    from autopar.ir.pipeline_program import build_pipeline_program
    from autopar.ir.repeats import find_repeats

    model = get_model("gpt", "tiny", num_layers=24).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 1)
    positions = remat_layer_positions(pp, build_graph(pp.forward))
    grid = find_repeats(pp.forward, positions)
    assert grid is not None and grid.whole_blocks(len(pp.forward.eqns)) == 24
    blocks = set(grid.cuts_within(0, len(pp.forward.eqns)))
    assert blocks <= set(positions) and len(positions) > DEFAULT_MAX_LAYERS
    assert positions == sorted(set(positions)) and positions[0] > 0
