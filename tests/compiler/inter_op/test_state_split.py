"""The memory-lean stage candidates' ladder (``remat.state_split_levels``): every parameter
split at least k ways, for each k one mesh axis or several give, and the restriction of a
layer's ILP to such layouts (``sharding_ilp.state_split_at_least``)."""

from __future__ import annotations

import numpy as np

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.remat import (
    LayerSums,
    is_remat_key,
    is_selective_key,
    remat_candidates,
    state_split_levels,
    state_split_of_key,
)
from autopar.compiler.inter_op.submesh import SubmeshShape
from autopar.compiler.planners.stage_costs import layer_cost_cache, submesh_mesh
from autopar.ir.pieces import cut_pieces
from autopar.ir.pipeline_pieces import piece_roles
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model


def test_the_levels_are_the_products_of_the_mesh_axes_least_first():
    assert state_split_levels((8,)) == [8]
    assert state_split_levels((1, 8)) == [8]
    assert state_split_levels((32, 8)) == [8, 32, 256]
    assert state_split_levels((4, 4)) == [4, 16]
    assert state_split_levels((2, 2, 4)) == [2, 4, 8, 16]
    assert state_split_levels((1,)) == []


def test_the_levels_are_plain_ints_whatever_the_shape_was_given_as():
    # the levels are kept per shape: a shape of numpy ints asked first must not hand its
    # numpy products to the same shape of ints (they would reach keys and the plan's JSON)
    first = state_split_levels((np.int64(3), np.int64(5)))
    again = state_split_levels((3, 5))
    assert first == again == [3, 5, 15]
    assert all(type(k) is int for k in (*first, *again))
    assert remat_candidates(LayerSums(), (np.int64(3), np.int64(5)), "none")[0].key == "3x5"


def test_the_key_names_the_level_and_remat_stays_readable():
    costs = LayerSums(time_s=1.0, remat_time_s=1.5)
    keys = [c.key for c in remat_candidates(costs, (2, 4), "auto", split=4)]
    assert keys == ["2x4+split4", "2x4+split4+selective", "2x4+split4+remat"]
    assert [state_split_of_key(k) for k in keys] == [4, 4, 4]
    assert [is_remat_key(k) for k in keys] == [False, True, True]
    assert [is_selective_key(k) for k in keys] == [False, True, False]
    assert state_split_of_key("2x4") == 1 and state_split_of_key("2x4+remat") == 1


def test_each_level_splits_every_kernel_at_least_so_and_is_no_faster():
    model = get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 2)
    positions = layer_positions(pp, build_graph(pp.forward), 2, 8)
    piece = cut_pieces(pp.forward, positions)[1]
    cache = layer_cost_cache(autopar.PipeshardParallel(num_microbatches=2))
    mesh = submesh_mesh(load_cluster("cpu-sim"), SubmeshShape(1, 8), (2, 4))
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    previous = cache.cost(pp, piece, mesh)
    kernels = [v for v in piece_roles(pp, piece).params if len(pp.forward.avals[v].shape) == 2]
    assert kernels
    for split in state_split_levels(mesh.shape):
        cost = cache.cost(pp, piece, mesh, split=split)
        assert all(cost.input_specs[v].num_shards(sizes) >= split for v in kernels)
        # a smaller set of layouts: never faster, never more parameter bytes
        assert cost.per_microbatch_s(2) >= previous.per_microbatch_s(2) * (1 - 1e-3)
        assert cost.param_bytes <= previous.param_bytes + 1e-9
        previous = cost
