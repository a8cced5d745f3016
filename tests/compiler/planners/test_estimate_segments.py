"""A pipeline candidate's whole-step estimate counts the driver's work on the step's segments
(``ir/pipeline_segments.plan_segments``), which depend on the stages' layers only: the
schedules' searches share them (the equal splits, a replica count's DP), so each distinct
partition's segments are made once per layer cost cache, and every estimate is the one
counted afresh."""

from __future__ import annotations

import dataclasses

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.inter_op.pipeline_cost import driver_counts
from autopar.compiler.planners import pipeline_candidate
from autopar.compiler.planners.pipeline_candidate import piece_owners
from autopar.compiler.planners.pipeline_search import search_pipeshard
from autopar.compiler.planners.stage_costs import layer_cost_cache, range_pieces
from autopar.ir.pipeline_program import build_pipeline_program
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
