"""The layer-cost cache: identical layers share one ILP per mesh, whichever of them is met first
on each mesh (a regression: the second layer met first on a new mesh used to fail)."""

import autopar
from autopar.api import local_cluster
from autopar.compiler.cost.mesh import LogicalMesh
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layer_costs import piece_signature
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.planners.stage_costs import layer_cost_cache, range_piece
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model


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
