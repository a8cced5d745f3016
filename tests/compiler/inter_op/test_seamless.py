"""A stage piece of repeated blocks whose blocks' plans agree at their seams runs those plans
(``LayerCostCache.seamless_cost``), not its own ILP solved again whole: nothing between the
blocks is resharded that their summed cost, by which the stage search priced the piece, left
out. Planning only; nothing is timed."""

from __future__ import annotations

import dataclasses

import pytest
from cluster_variants import without_waves

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.planners import stage_costs
from autopar.ir.pipeline_pieces import cut_pieces
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model
from autopar.plan import ShardingSpec


@pytest.fixture(scope="module")
def gpt_layer():
    """GPT-2.6B's shapes, 4 blocks cut into 2 layers, on a 2 x 4 mesh of one p3.16xlarge (at
    tiny sizes the blocks' plans read their input in another layout than they make it),
    every GEMM at one fraction of the peak (with the V100's waves, ``cost.gemm``, the two
    blocks' plans meet in different layouts: the seam this test needs agreeing)."""
    model = get_model("gpt", "2.6B", num_layers=4, batch_size=32, seq_len=1024
                      ).with_value_and_grad(autopar.value_and_grad)
    cluster = without_waves(load_cluster("aws-p3.16xlarge-8nodes").with_hosts(1))
    method = autopar.PipeshardParallel(num_microbatches=2, layers=2, planning_workers=1)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 2)
    positions = layer_positions(pp, build_graph(pp.forward), 2, cluster.num_devices)
    cache = stage_costs.layer_cost_cache(method)
    table = stage_costs.stage_cost_table(pp, positions, method, cluster, cache, prefetch_on=())
    mesh = stage_costs.submesh_mesh(cluster, table.submeshes[-1], (2, 4))
    second = cut_pieces(pp.forward, positions)[1]
    return pp, cache, mesh, second


def test_agreeing_seams_run_the_blocks_plans(gpt_layer):
    pp, cache, mesh, second = gpt_layer
    units = cache.units(pp, second)
    assert len(units) >= 2  # cut at the repeated blocks' boundaries
    composed = cache.seamless_cost(pp, second, mesh)
    assert composed is cache.layer_cost(pp, second, mesh)  # the sum the stage search read
    # each block passes the next its outputs in the layouts that block reads them
    for before, after in zip(units, units[1:], strict=False):
        made = {v for i in before.eqns for v in pp.forward.eqns[i].outputs}
        seams = {v: s for v, s in cache.cost(pp, after, mesh).input_specs.items() if v in made}
        assert seams and all(composed.value_specs[v] == s for v, s in seams.items())
    # the piece's own ILP finds a plan a little cheaper at most
    whole = cache.cost(pp, second, mesh, time_limit_s=60.0)
    assert whole.time_s + whole.sync_s + whole.update_s == pytest.approx(
        composed.time_s + composed.sync_s + composed.update_s, rel=1e-3)


def test_a_seam_read_in_another_layout_is_solved_whole(gpt_layer, monkeypatch):
    pp, cache, mesh, second = gpt_layer
    units = cache.units(pp, second)
    made = {v for i in units[0].eqns for v in pp.forward.eqns[i].outputs}
    real = cache.cost
    read = real(pp, units[1], mesh)
    seam = next(v for v in read.input_specs if v in made)
    rank = len(pp.forward.avals[seam].shape)
    axis = mesh.axis_names[0]
    layouts = [ShardingSpec(tuple((axis,) if d == k else () for d in range(rank)))
               for k in range(rank)] + [ShardingSpec.replicated(rank)]
    other = next(s for s in layouts if s != read.input_specs[seam])

    def cost(pp_, piece, mesh_, time_limit_s=None, *, split=1):
        found = real(pp_, piece, mesh_, time_limit_s, split=split)
        if piece is units[1]:  # the second block reads the seam in another layout
            found = dataclasses.replace(found, input_specs={**found.input_specs, seam: other})
        return found

    monkeypatch.setattr(cache, "cost", cost)
    assert cache.seamless_cost(pp, second, mesh) is None
