"""A layer is costed per repeated block (``repeats``, ``LayerCostCache.layer_cost``): the
block is found from the equations, a layer of several blocks costs their sum, and the
blocks are one ILP per mesh."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.submesh import SubmeshShape
from autopar.compiler.planners.stage_costs import layer_cost_cache, submesh_mesh
from autopar.ir.pieces import cut_pieces
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.ir.repeats import RepeatGrid, find_repeats
from autopar.models import get_model


def _gpt(num_layers: int):
    model = get_model("gpt", "tiny", num_layers=num_layers).with_value_and_grad(
        autopar.value_and_grad)
    return build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 4)


def test_the_repeated_block_is_a_transformer_layer():
    pp = _gpt(6)
    positions = layer_positions(pp, build_graph(pp.forward), 6, 16)
    grid = find_repeats(pp.forward, positions)
    assert grid is not None
    pieces = cut_pieces(pp.forward, positions)
    # the clustering's middle layers are one block each: the block is as long, and its
    # boundaries fall where the clustering cut
    middle = {len(p.eqns) for p in pieces[1:-2]}
    assert middle == {grid.period}
    assert all(grid.cuts_within(p.eqns[0] - 1, p.eqns[0] + 1) == [p.eqns[0]]
               for p in pieces[1:-1] if grid.start <= p.eqns[0] <= grid.end)
    assert grid.num_blocks >= 5


def test_the_grid_cuts_only_inside_the_span_and_the_blocks():
    grid = RepeatGrid(period=10, start=5, end=45)
    assert grid.cuts_within(0, 30) == [5, 15, 25]
    assert grid.cuts_within(5, 15) == []
    assert grid.cuts_within(40, 60) == [45]
    assert grid.cuts_within(46, 90) == []


def test_a_model_without_repeated_blocks_has_no_grid():
    model = get_model("mlp", "tiny").with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 2)
    grid = find_repeats(pp.forward)
    # any repeat found spans at least two blocks of MIN_BLOCK_EQNS equations
    assert grid is None or grid.num_blocks >= 2 and grid.period >= 8


@pytest.mark.parametrize("submesh,shape", [((1, 8), (8,)), ((1, 8), (2, 4)),
                                           ((2, 8), (4, 4))])
def test_a_layer_of_blocks_costs_the_sum_of_its_blocks_at_one_ilp_per_block(submesh, shape):
    """Six blocks clustered into two layers: each layer's cost from its blocks is its own
    ILP's (the same time within 3%, the same bytes), and the blocks cost one ILP per mesh
    besides the embedding's and the head's parts."""
    pp = _gpt(6)
    positions = layer_positions(pp, build_graph(pp.forward), 2, 16)
    layers = cut_pieces(pp.forward, positions)
    cluster = dataclasses.replace(load_cluster("aws-p3.16xlarge"), num_hosts=2)
    mesh = submesh_mesh(cluster, SubmeshShape(*submesh), shape)
    method = autopar.PipeshardParallel(num_microbatches=4, layers=2)
    blocks = layer_cost_cache(method)
    blocks.use_layers(pp, positions)
    whole = layer_cost_cache(method)  # never given the layers: no grid, layers solved whole
    for layer in layers:
        units = blocks.units(pp, layer)
        assert len(units) >= 3  # three blocks, and the embedding or the head
        summed, own = blocks.layer_cost(pp, layer, mesh), whole.layer_cost(pp, layer, mesh)
        # within 3%: the blocks' layouts meet unpriced at their boundaries, and each block's
        # own graph reads and writes there what the layer's fused kernels may keep on chip
        # (the roofline's bytes; at this tiny width a few percent of a layer's time)
        assert summed.time_s == pytest.approx(own.time_s, rel=0.03)
        assert summed.activation_bytes == pytest.approx(own.activation_bytes, rel=1e-9)
        assert summed.boundary_bytes == pytest.approx(own.boundary_bytes, rel=1e-9)
        # parameters: laid out as each block's ILP chose (memory-blind, so either ILP may
        # break a tie the other way), held as the whole layer's are: with their gradient
        # accumulators and optimizer state
        assert summed.fixed_bytes == pytest.approx(
            summed.param_bytes * own.fixed_bytes / own.param_bytes, rel=1e-9)
        # the plan names the layer's own inputs, as the whole layer's does
        assert set(summed.input_specs) == set(own.input_specs)
    assert whole.ilp_solves == len(layers)
    # the six blocks are one ILP; at most the embedding's and the head's units beside it,
    # and the parts of a block the clustering cut
    assert blocks.ilp_solves <= 5 < sum(len(blocks.units(pp, layer)) for layer in layers)
