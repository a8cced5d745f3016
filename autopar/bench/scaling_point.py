"""Running one scaling point of a benchmark suite: the full search planned at one model depth
or device count, its planning time by phase, and what its estimated step is bound by.
"""

from __future__ import annotations

import time
from typing import Any

from autopar.bench.planning import full_search, ilp_solves, plan_summary, planning_times
from autopar.bench.runner import Phase, candidate_summaries
from autopar.bench.suites import NO_MEMORY_LIMIT, ScalingAxis, ScalingPoint
from autopar.cluster import load_cluster
from autopar.models import get_model
from autopar.plan import Plan


def run_scaling_point(point: ScalingPoint, phase: Phase) -> dict[str, Any]:
    """Plan one scaling point with the full search; its planning times by phase."""
    overrides = dict(point.overrides) | {"num_layers": point.num_layers}
    model = get_model(point.model, point.size, **overrides)
    cluster = load_cluster(point.cluster)
    cluster = cluster.with_devices(point.hosts, point.devices_per_host or cluster.devices_per_host)
    wall = time.perf_counter()
    with phase(f"scaling: {point.name}"):
        searched = full_search(model, cluster, microbatches=point.microbatches,
                               pipeline_layers=point.pipeline_layers,
                               memory_budget_bytes=NO_MEMORY_LIMIT)
    plan = searched.plan
    x = point.num_layers if point.axis is ScalingAxis.LAYERS else cluster.num_devices
    return {
        "kind": "scaling", "axis": point.axis.value, "x": x, "case": point.name,
        "model": point.model, "size": point.size, "num_layers": point.num_layers,
        "cluster": cluster.name, "hosts": cluster.num_hosts, "devices": cluster.num_devices,
        "microbatches": point.microbatches, "batch": getattr(model.config, "batch_size", None),
        "planning": planning_times(searched.trace_s, plan),
        "ilp_solves": ilp_solves(plan),
        "est_step_time_s": plan.est_step_time_s, "plan": plan_summary(plan),
        "estimate": dict(plan.planning.estimate), "bound_by": bound_by(plan),
        "candidates": candidate_summaries(plan),
        "wall_s": time.perf_counter() - wall,
    }


_BOUND_PARTS = {
    "compute_s": "compute", "communication_s": "communication inside the mesh",
    "runtime_s": "the runtime's call", "schedule_s": "the pipeline's stages (compute and "
    "communication per microbatch, bubbles included)", "tails_s": "the stages' gradient "
    "reduction and update (with replicas: their all-reduce between hosts)",
    "before_s": "preprocessing", "host_s": "the driver on the host",
}


def bound_by(plan: Plan) -> str:
    """What the plan's estimated step time is mostly made of (its largest part)."""
    parts = {k: float(v) for k, v in plan.planning.estimate.items()
             if k in _BOUND_PARTS and isinstance(v, int | float)}
    if not parts:
        return ""
    key = max(parts, key=parts.__getitem__)
    total = plan.est_step_time_s or 1.0
    return f"{_BOUND_PARTS[key]} ({parts[key] / total:.0%})"
