"""A pipeline replicated over groups of hosts: the replicas' all-reduce of a stage's gradients
is priced hierarchically (each device all-reduces its 1/n slice of the stage's parameters
with the other replicas; the stage's own reduction carries the reduce-scatter and the
all-gather), not as a second flat all-reduce of each device's whole gradients; and such a
pipeline of one stage with one microbatch per replica competes like any one-stage plan."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.cost.collectives import allreduce_time
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.pipeline_cost import replica_allreduce_time
from autopar.compiler.planners.candidate_screens import cut_one_stage as _cut_one_stage
from autopar.compiler.planners.stage_costs import layer_cost_cache
from autopar.compiler.planners.stage_table import stage_cost_table
from autopar.ir.pieces import cut_pieces
from autopar.ir.pipeline_pieces import piece_roles
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.models import get_model


def test_the_replicas_all_reduce_each_devices_slice_of_the_stages_gradients():
    model = get_model("gpt", "tiny", num_layers=2).with_value_and_grad(autopar.value_and_grad)
    whole = load_cluster("aws-p3.16xlarge-8nodes").with_hosts(4)
    group = whole.with_hosts(2)
    method = autopar.PipeshardParallel(num_microbatches=4, layers=2, planning_workers=1)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 4)
    positions = layer_positions(pp, build_graph(pp.forward), 2, group.num_devices)
    # each layer's parameters, unsplit (a parameter two layers read, the tied embedding,
    # once per layer: each layer's stage holds and reduces its own copy)
    fwd = pp.forward
    param_bytes = sum(math.prod(fwd.avals[v].shape) * fwd.avals[v].dtype.itemsize
                      for piece in cut_pieces(fwd, positions)
                      for v in piece_roles(pp, piece).params)
    cache = layer_cost_cache(method)
    tables = {r: stage_cost_table(pp, positions, method, group, cache, num_microbatches=2,
                                  replicas=r, whole=whole, prefetch_on=())
              for r in (1, 2)}
    every = len(tables[1].submeshes) - 1  # the whole group of 2 hosts
    devices = tables[1].submeshes[every].num_devices
    one, two = (tables[r].candidates(0, len(positions) + 1, every) for r in (1, 2))
    assert len(one) == len(two) > 0
    link = whole.inter_host
    added = allreduce_time(param_bytes / devices, 2, link.alpha, link.beta)
    assert added == pytest.approx(replica_allreduce_time(param_bytes, devices, 2, whole))
    for single, replicated in zip(one, two, strict=True):
        assert replicated.tail_time - single.tail_time == pytest.approx(added, rel=1e-6)
    # the stage's layouts keep some parameters whole on several devices: priced flat, each
    # device's whole gradients would have crossed the hosts' links a second time
    flat = max(allreduce_time(c.param_bytes, 2, link.alpha, link.beta) for c in two)
    assert flat > 1.5 * added


@pytest.mark.parametrize("replicas, microbatches, cut", [(1, 4, True), (2, 4, True),
                                                        (4, 4, False), (1, 1, False)])
def test_a_replicated_stage_with_one_microbatch_each_is_not_a_cut_step(replicas, microbatches,
                                                                       cut):
    """The full search keeps a one-stage pipeline only when no one-stage plan fits, as it is
    the one-stage step cut into microbatches, whose costs its estimate leaves out; replicated
    with one microbatch per replica nothing is cut, and it competes like any plan."""
    layout = SimpleNamespace(replicas=replicas)
    plan = SimpleNamespace(stages=[object()], num_microbatches=microbatches, pipeline=layout)
    assert _cut_one_stage(plan) is cut
    two = SimpleNamespace(stages=[object(), object()], num_microbatches=microbatches,
                          pipeline=layout)
    assert not _cut_one_stage(two)
