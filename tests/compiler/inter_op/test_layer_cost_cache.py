"""The layer-cost cache: identical layers share one ILP per mesh, whichever of them is met first
on each mesh (a regression: the second layer met first on a new mesh used to fail), and a piece
that runs is solved under the method's time limit."""

import os
from dataclasses import replace

import pytest

import autopar
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.piece_cost import piece_signature, solve_status
from autopar.compiler.planners.stage_costs import layer_cost_cache, range_piece
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model
from autopar.runtime.local_cluster import local_cluster


def test_identical_layers_met_on_different_meshes_share_their_solves():
    model = get_model("gpt", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 2)
    method = autopar.PipeshardParallel(num_microbatches=2, layers=4)
    positions = layer_positions(pp, build_graph(pp.forward), method.layers, 8)
    cache = layer_cost_cache(method)
    cluster = local_cluster()
    mesh_a = LogicalMesh.from_cluster(cluster.with_devices(1, 4), (4,))
    mesh_b = LogicalMesh.from_cluster(cluster.with_devices(1, 4), (2, 2))
    first, second = range_piece(pp, positions, 1, 2), range_piece(pp, positions, 2, 3)
    assert piece_signature(pp, first) == piece_signature(pp, second)  # two identical blocks
    a1 = cache.cost(pp, first, mesh_a)
    b2 = cache.cost(pp, second, mesh_b)  # the second block, first seen on this mesh
    a2 = cache.cost(pp, second, mesh_a)  # a hit: renamed from the first block's solve
    b1 = cache.cost(pp, first, mesh_b)
    assert cache.ilp_solves == 2
    assert a1.time_s == a2.time_s and b1.time_s == b2.time_s
    # specs name each piece's own values
    assert b2.input_specs and set(b2.input_specs) != set(b1.input_specs)
    assert [s.to_string() for s in b1.input_specs.values()] == \
        [s.to_string() for s in b2.input_specs.values()]


def test_a_piece_that_runs_is_solved_again_under_its_own_limit_when_the_table_stopped_early():
    """The stage-cost table solves pieces under a short limit; the pieces a plan runs are solved
    under the method's, again where the table's solve stopped at its limit (a load-dependent
    incumbent: the planner gave one-stage GPT pipelines other layouts run to run)."""
    model = get_model("gpt", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 4)
    method = autopar.PipeshardParallel(num_microbatches=4, layers=4)
    positions = layer_positions(pp, build_graph(pp.forward), method.layers, 8)
    cache = layer_cost_cache(method)
    # a table limit no solver meets for a whole stage of 4 blocks (building its model alone
    # takes longer): the solve stops with the best plan it had
    cache.options = replace(cache.options, time_limit_s=1e-3)
    mesh = LogicalMesh.from_cluster(local_cluster().with_devices(1, 8), (2, 4))
    stage = range_piece(pp, positions, 0, len(positions) + 1)
    assert solve_status(cache.cost(pp, stage, mesh)) in ("time_limit", "no_solution")
    assert cache.ilp_solves == 1
    ran = cache.cost(pp, stage, mesh, time_limit_s=method.time_limit_s)
    assert solve_status(ran) in ("proven", "within_gap") and cache.ilp_solves == 2
    # a solve that ended within its gap is not repeated, whatever the limit asked
    assert cache.cost(pp, stage, mesh, time_limit_s=method.time_limit_s) == ran
    assert cache.cost(pp, stage, mesh) == ran and cache.ilp_solves == 2


def test_a_lean_variant_whose_less_split_plan_already_qualifies_is_not_solved_again():
    """The memory-lean variants' ILPs are nested restrictions: where the fastest plan already
    splits every parameter k ways, it is the split-k optimum too, and no ILP is solved for it
    (``meets_state_split``). Checked against that level solved alone, in a cache that has no
    less-split plan to reuse."""
    from autopar.compiler.inter_op.remat import state_split_levels

    # a wide layer on a small batch: the fastest plan on 2 x 4 splits its weights over one axis
    model = get_model("gpt", "tiny", num_layers=4, batch_size=2, hidden_size=1024,
                      seq_len=64).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 2)
    method = autopar.PipeshardParallel(num_microbatches=2, layers=4)
    positions = layer_positions(pp, build_graph(pp.forward), method.layers, 8)
    mesh = LogicalMesh.from_cluster(local_cluster().with_devices(1, 8), (2, 4))
    block = range_piece(pp, positions, 1, 2)
    cache = layer_cost_cache(method)
    levels = (1, *state_split_levels(mesh.shape))
    costs = {split: cache.cost(pp, block, mesh, split=split) for split in levels}
    derived = [split for split, c in costs.items() if c.derived]
    assert derived == [2]  # its fastest plan splits each weight over the 2-way axis, not 4
    assert cache.derived_levels == 1 and cache.ilp_solves == len(levels) - 1
    alone = layer_cost_cache(method)
    solved = alone.cost(pp, block, mesh, split=2)
    assert not solved.derived and alone.ilp_solves == 1
    gap = max(solved.ilp_gap or 0.0, costs[1].ilp_gap or 0.0) + 1e-9
    assert abs(costs[2].time_s - solved.time_s) <= gap * solved.time_s
    assert costs[2].input_specs == costs[1].input_specs
    assert costs[4].time_s > costs[2].time_s  # the next level did need its own ILP


def test_the_lean_rungs_are_the_same_whichever_process_solved_the_rungs_below(monkeypatch):
    """A memory-lean rung's dual ascent starts from the messages its rung below ended with
    (``dual_bound.WarmMessages``), which travel with that rung's cost: the forked prefetch
    (each mesh's rungs in one child) and this process solving each rung when asked give the
    same plans. Every ILP takes dual ascent here (no elimination, no pair floor), so every
    rung above the first starts warm."""
    from autopar.compiler.inter_op import layer_costs
    from autopar.compiler.inter_op.remat import state_split_levels
    from autopar.compiler.intra_op import ilp

    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    monkeypatch.setattr(ilp, "DUAL_BOUND_MIN_PAIRS", 0)
    monkeypatch.setattr(ilp, "solve_by_elimination", lambda r: None)
    monkeypatch.setattr(layer_costs, "PARALLEL_MIN_SOLVES", 0)
    model = get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 2)
    method = autopar.PipeshardParallel(num_microbatches=2, layers=2)
    positions = layer_positions(pp, build_graph(pp.forward), method.layers, 8)
    cluster = local_cluster().with_devices(1, 8)
    meshes = [LogicalMesh.from_cluster(cluster, shape) for shape in ((2, 4), (4, 2))]
    pieces = [range_piece(pp, positions, k, k + 1) for k in range(len(positions) + 1)]

    def every_rung(cache):
        return [(c.choices, c.time_s, c.derived)
                for mesh in meshes for split in (1, *state_split_levels(mesh.shape))
                for c in [cache.cost(pp, piece, mesh, split=split) for piece in pieces]]

    forked = layer_cost_cache(method)
    forked.prefetch(pp, pieces, meshes, lambda mesh, costs: True, workers=2)
    solved = forked.ilp_solves
    here = layer_cost_cache(method)
    assert every_rung(forked) == every_rung(here)
    assert forked.ilp_solves == solved  # the prefetch had solved every rung
    # and so are the messages each structure's latest rung ended with (a rung started cold
    # here would end elsewhere than the same rung started warm in a child)
    def messages(cache):
        return {key: {edge: (ids.tolist(), values.tolist())
                      for edge, (ids, values) in cost.dual_messages.items()}
                for key, (cost, _) in cache.solved.items() if cost.dual_messages is not None}

    kept = messages(here)
    assert kept and kept == messages(forked)
    assert all(key[-1] > 1 for key in kept)  # only the top rungs keep theirs
