"""The pipelines the stage DP cannot or need not find, compared beside its own: the
equal-layer and equal-operator splits with as many stages (``hand_splits``; Alpa's baselines,
judged by the same whole-step estimate, so one can win), and on many hosts the deep
equal-block pipelines of more stages than the DP has layers (``deep_equal_splits``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cluster import ClusterSpec
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.layers import layer_positions
from autopar.compiler.inter_op.stages import (
    StageCostTable,
    StagePartition,
    solve_stages,
    uniform_stages,
)
from autopar.compiler.planners.pipeline_candidate import (
    PipelineCandidate,
    estimate_candidate,
    forward_graph,
)
from autopar.compiler.planners.stage_costs import layer_cost_cache, stage_dp_options
from autopar.compiler.planners.stage_table import CostClock, stage_cost_table
from autopar.errors import PlanError
from autopar.ir.pipeline_program import PipelineProgram
from autopar.methods import PipeshardParallel


def hand_split_counts(dp_stages: int, max_tries: int = 4) -> list[int]:
    """Stage counts for the equal-layer and equal-operator splits beside a DP that chose
    ``dp_stages``: that many (two when it chose one: a one-stage "split" is no pipeline), then
    the nearest counts (more stages first) for when it does not split the layers and devices
    evenly. The first that does is used (by the planner and the benchmark alike)."""
    wanted = max(2, dp_stages)
    counts = sorted(range(2, wanted + max_tries + 1), key=lambda c: (abs(c - wanted), -c))
    return counts[:max_tries]


def stage_baselines(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec, *,
                    cache: LayerCostCache | None = None,
                    num_stages: int | None = None) -> dict[str, StagePartition]:
    """The DP's stages beside the two usual hand splits with as many stages: equal layers on
    equal submeshes, and equal numbers of operators on equal submeshes (by the DP's own
    formula; :func:`hand_splits` gives their whole-step estimates).

    ``cache``: layer costs already solved (``layer_cost_cache``). ``num_stages``: the hand
    splits' stage count instead of the DP's (PlanError when it does not split the layers and
    devices evenly)."""
    cache = cache if cache is not None else layer_cost_cache(method)
    graph = forward_graph(pp, cache)
    options = stage_dp_options(method, cluster)
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    positions = layer_positions(pp, graph, method.layers, cluster.num_devices)
    table = stage_cost_table(pp, positions, method, cluster, cache, prefetch_on=())
    best = solve_stages(table, hosts, per_host, options)
    p = num_stages if num_stages is not None else len(best.stages)
    found = {"dp": best}
    if p > 1:
        found["equal-layer"] = uniform_stages(table, p, hosts, per_host, options)
        ops = operator_positions(pp, p)
        ops_table = stage_cost_table(pp, ops, method, cluster, cache, prefetch_on=())
        found["equal-operator"] = uniform_stages(ops_table, p, hosts, per_host, options)
    return found


def operator_positions(pp: PipelineProgram, num_stages: int) -> list[int]:
    """Cuts of the loss forward into ``num_stages`` pieces of equal operator counts (inside
    blocks where they fall there: at GPT-39B the balance that buys is the best plan, 96.4
    against 98.2 s per step with the cuts moved to block boundaries)."""
    n = len(pp.forward.eqns)
    return [round(k * n / num_stages) for k in range(1, num_stages)]


def deep_stage_counts(blocks: int, num_layers: int, num_hosts: int,
                      num_devices: int) -> list[int]:
    """Stage counts beyond the stage DP's ``num_layers`` layers that split the forward's
    ``blocks`` repeated blocks and the devices (whole hosts per stage on several hosts) into
    equal parts."""
    units = num_hosts if num_hosts > 1 else num_devices
    return [p for p in range(num_layers + 1, blocks + 1)
            if blocks % p == 0 and units % p == 0]


def deep_equal_splits(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                      cache: LayerCostCache, num_layers: int,
                      clock: CostClock | None = None, *,
                      beat: float = math.inf) -> list[PipelineCandidate]:
    """Pipelines of more stages than the stage DP has layers, which it cannot build: for
    each count of :func:`deep_stage_counts`, the forward clustered into that many layers, one
    per stage, on equal submeshes (Megatron-LM's deep pipelines: GPT 529.6B's 105 layers in
    35 stages of 9 hosts), each with its whole-step estimate. The stage DP's layers stay few
    (``layers.DEFAULT_MAX_LAYERS``): its time grows with their square, these with their
    count. A split is estimated only where its bound is below ``beat`` (the best pipeline
    found so far): the step takes at least each stage's microbatches back to back and then
    its tail, and simulating a schedule of 105 stages and 280 microbatches takes seconds."""
    grid = cache.grid
    if grid is None or pp.layer_scans:
        return []
    blocks = grid.whole_blocks(len(pp.forward.eqns))
    counts = deep_stage_counts(blocks, num_layers, cluster.num_hosts, cluster.num_devices)
    if not counts:
        return []
    graph = forward_graph(pp, cache)
    options = stage_dp_options(method, cluster)
    m = method.num_microbatches
    out = []
    for count in counts:
        try:
            positions = layer_positions(pp, graph, count, cluster.num_devices)
            table = stage_cost_table(pp, positions, method, cluster, cache, clock,
                                     prefetch_on=())
            split = uniform_stages(table, count, cluster.num_hosts, cluster.devices_per_host,
                                   options)
        except PlanError:  # no submesh of that size, or nothing fits
            continue
        if max(m * st.candidate.time + st.candidate.tail_time for st in split.stages) >= beat:
            continue
        estimate = estimate_candidate(pp, split, positions, method.schedule, m, 1, cluster, cache)
        out.append(PipelineCandidate("equal-block", split, tuple(positions), 1, m, cluster,
                                     estimate, note=f"{count} stages of {blocks // count} "
                                     f"of the {blocks} repeated blocks"))
    return out


def hand_splits(pp: PipelineProgram, method: PipeshardParallel, cluster: ClusterSpec,
                cache: LayerCostCache, positions: Sequence[int], table: StageCostTable,
                dp_stages: int, clock: CostClock | None = None) -> list[PipelineCandidate]:
    """The equal-layer and equal-operator splits beside a DP that chose ``dp_stages`` (as
    many stages, or the nearest count that splits evenly: :func:`hand_split_counts`), each
    with its whole-step estimate; [] when no count near it splits evenly."""
    options = stage_dp_options(method, cluster)
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    m = method.num_microbatches
    for count in hand_split_counts(dp_stages):
        try:
            layer_split = uniform_stages(table, count, hosts, per_host, options)
            ops = operator_positions(pp, count)
            # the same count of equal stages: on the equal-layer split's submesh
            ops_table = stage_cost_table(pp, ops, method, cluster, cache, clock,
                                         prefetch_on=(layer_split.stages[0].submesh,),
                                         stage_layers=1)
            op_split = uniform_stages(ops_table, count, hosts, per_host, options)
        except PlanError:
            continue
        if count == dp_stages:
            note = f"{count} stages, as the DP's"
        elif dp_stages == 1:
            note = f"{count} stages (the DP chose one stage: no pipeline)"
        else:
            note = f"{count} stages (the DP's {dp_stages} do not split evenly)"
        out = []
        for name, part, cuts in (("equal-layer", layer_split, positions),
                                 ("equal-operator", op_split, ops)):
            estimate = estimate_candidate(pp, part, cuts, method.schedule, m, 1, cluster, cache)
            out.append(PipelineCandidate(name, part, tuple(cuts), 1, m, cluster, estimate,
                                         note=note))
        return out
    return []
