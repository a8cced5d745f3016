"""Pipelines of more stages than the stage DP has layers (``pipeline_splits.deep_equal_splits``):
Megatron-LM runs GPT 529.6B in 35 stages of its 105 layers, which a DP over at most 16 layers
cannot build. Planned on abstract shapes; nothing here runs a step or is timed."""

import dataclasses

import pytest

import autopar
from autopar.cluster import load_cluster
from autopar.compiler.planners import dispatch
from autopar.compiler.planners.pipeline_search import search_pipeshard
from autopar.compiler.planners.pipeline_splits import deep_equal_splits, deep_stage_counts
from autopar.models import get_model


@pytest.mark.parametrize("blocks, layers, hosts, devices, counts", [
    (105, 16, 315, 2520, [21, 35, 105]),  # GPT 529.6B on 315 DGX A100 hosts
    (48, 16, 8, 64, []),                  # GPT-39B on Alpa's 8 hosts: the DP's layers do
    (128, 16, 384, 3072, [32, 64, 128]),  # GPT 1T on 384 hosts
    (32, 4, 1, 8, [8]),                   # one host: stages of one device
    (12, 6, 12, 12, [12]),
])
def test_deep_stage_counts_split_blocks_and_hosts_evenly(blocks, layers, hosts, devices, counts):
    assert deep_stage_counts(blocks, layers, hosts, devices) == counts


def test_a_stage_per_layer_is_estimated_as_its_pinned_plan_and_pruned_by_its_bound():
    """GPT of 12 layers on 12 described one-device hosts: the stage DP cuts 6 layers, so a
    12-stage pipeline is the deep split's, one repeated block per stage, estimated exactly as
    the same configuration pinned. The search estimates it only where its bound (each
    stage's microbatches back to back, then its tail) is below the best pipeline found:
    here the DP's replicated pipelines are far faster, so it is skipped."""
    model = get_model("gpt", "tiny", num_layers=12, batch_size=24).with_value_and_grad(
        autopar.value_and_grad)
    cluster = load_cluster("cpu-sim").with_devices(12, 1)
    # its kernels' launches left out, and its matmuls at the general rate: with them (every
    # stage launches its kernels once per microbatch; the host's GEMM rate makes the layers'
    # compute small beside that) the estimates close in and the deep split is not pruned;
    # so are the costs of each array's buffer and of the batch fed in a one-program step's
    # call (its ~900 arrays, 0.45 ms, go to the pipelines run as one program only)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, kernel_launch_s=0.0, gemm_flops={}),
        runtime=dataclasses.replace(cluster.runtime, buffer_s=0.0, feed_s=0.0))
    method = autopar.PipeshardParallel(num_microbatches=12, schedule="1f1b", remat="none")
    step = dispatch.trace(model.train_step, model.abstract_inputs(), method, (1,))
    pp = step.pipeline
    search = search_pipeshard(pp, method, cluster)
    assert search.cache.grid.whole_blocks(len(pp.forward.eqns)) == 12
    dp = next(c for c in search.found if c.name == "stage DP")
    assert len(dp.positions) + 1 == 6  # the DP's own layers: fewer than the stages below

    deep = deep_equal_splits(pp, method, cluster, search.cache, len(dp.positions) + 1)
    assert len(deep) == 1 and len(deep[0].partition.stages) == 12
    assert [(s.start, s.end) for s in deep[0].partition.stages] == [(k, k + 1) for k in range(12)]
    assert deep[0].note == "12 stages of 1 of the 12 repeated blocks"
    pinned = autopar.pinned(1, 1, 12, num_microbatches=12, schedule="1f1b", remat="none")
    plan = dispatch.plan(dispatch.trace(model.train_step, model.abstract_inputs(), pinned,
                                        (1,)), cluster).plan
    assert len(plan.stages) == 12
    assert deep[0].estimate.total_s == pytest.approx(plan.est_step_time_s, rel=1e-9)

    bound = max(12 * s.candidate.time + s.candidate.tail_time for s in deep[0].partition.stages)
    assert bound <= deep[0].estimate.total_s
    best = search.best.estimate.total_s
    assert best < bound and best <= plan.est_step_time_s
    assert deep_equal_splits(pp, method, cluster, search.cache, 6, beat=best) == []
    assert not any(c.name == "equal-block" for c in search.found)
