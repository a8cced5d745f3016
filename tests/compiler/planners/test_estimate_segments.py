"""A pipeline candidate's whole-step estimate counts the driver's work on the step's segments
(``ir/pipeline_segments.plan_segments``), which depend on the stages' layers only: the
schedules' searches share them (the equal splits, a replica count's DP), so each distinct
partition's segments are made once per layer cost cache, and every estimate is the one
counted afresh."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.graph.trace import build_graph
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.pipeline_cost import driver_counts, least_driver_counts
from autopar.compiler.planners import pipeline_candidate
from autopar.compiler.planners.pipeline_candidate import piece_owners
from autopar.compiler.planners.pipeline_search import search_pipeshard
from autopar.compiler.planners.stage_costs import layer_cost_cache, range_pieces
from autopar.ir.pipeline_program import build_pipeline_program
from autopar.ir.schedules import ScheduleName, is_async
from autopar.models import get_model


def test_each_partitions_segments_are_made_once_and_count_as_made_afresh(monkeypatch):
    made = []
    real = pipeline_candidate.plan_segments

    def counted(pp, pieces, owner):
        made.append(tuple(owner))
        return real(pp, pieces, owner)

    monkeypatch.setattr(pipeline_candidate, "plan_segments", counted)
    model = get_model("gpt", "tiny", num_layers=4).with_value_and_grad(autopar.value_and_grad)
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), 4)
    cluster = load_cluster("aws-p3.16xlarge-8nodes").with_hosts(2)
    method = autopar.PipeshardParallel(num_microbatches=4, layers=4, planning_workers=1)
    cache = layer_cost_cache(method)
    searches = [search_pipeshard(pp, dataclasses.replace(method, schedule=name), cluster,
                                 cache=cache) for name in ("1f1b", "zb-h1")]
    keys, estimated = set(), 0
    for search in searches:
        for c in search.found:
            owner, ranges = piece_owners(len(c.partition.stages), c.chunks, c.partition,
                                         c.positions)
            keys.add((c.positions, tuple(ranges), tuple(owner)))
            fresh = driver_counts(pp, range_pieces(pp, c.positions, ranges), owner,
                                  search.method.schedule, c.num_microbatches, c.chunks)
            assert c.estimate.counts == fresh
            estimated += 1
    assert len(made) == len(keys) < estimated


@pytest.mark.parametrize("name", ["gpt", "moe", "llama", "wresnet"])
def test_no_pipeline_of_two_or_more_stages_counts_fewer_driver_operations_than_the_floor(name):
    """``least_driver_counts`` is what the full search prunes pipelines by
    (``pipeline_search.driver_floor_s``): every split of the layers into two or more stages,
    under every schedule (its asynchronous form under the asynchronous ones), interleaved too,
    counts at least its tasks and transfers; and the floor counts more than the tasks alone
    (each microbatch's batch slices, the parameters fetched, their gradients sent home, the
    update's inputs placed)."""
    model = get_model(name, "tiny").with_value_and_grad(autopar.value_and_grad)
    m = 4
    pp = build_pipeline_program(model.train_step, model.abstract_inputs(), (1,), m)
    positions = layer_positions(pp, build_graph(pp.forward), 4, 8)
    layers = len(positions) + 1
    least = least_driver_counts(pp, m)
    assert least.transfers > m * len(pp.loss_outputs) + 2 * len(pp.diff_inputs) > 0
    floors = {name: least_driver_counts(pp, m, is_async(name)) for name in ScheduleName}
    checked = 0
    for p in range(2, layers + 1):
        for cuts in itertools.combinations(range(1, layers), p - 1):
            bounds = [0, *cuts, layers]
            ranges = list(zip(bounds, bounds[1:], strict=False))
            pieces = range_pieces(pp, positions, ranges)
            for schedule in ScheduleName:
                if schedule == ScheduleName.INTERLEAVED_1F1B:
                    continue
                counts = driver_counts(pp, pieces, list(range(p)), schedule, m)
                floor = floors[schedule]
                assert counts.tasks >= floor.tasks and counts.transfers >= floor.transfers, \
                    (cuts, schedule)
                checked += 1
    # interleaved: p stages of 2 chunks each, a layer per chunk (Megatron's mapping)
    for p in (2,) if layers >= 4 else ():
        ranges = [(k, k + 1) for k in range(2 * p)]
        pieces = range_pieces(pp, positions, ranges)
        counts = driver_counts(pp, pieces, [k % p for k in range(2 * p)],
                               ScheduleName.INTERLEAVED_1F1B, m, 2)
        assert counts.tasks >= least.tasks and counts.transfers >= least.transfers
        checked += 1
    assert checked > 6
