"""Planning a zoo model with the full search, timed by phase, and the plan as plain rows.

Shared by the harness's cases and scaling points and by ``benchmarks/plan_pipeline.py``. The
full search is ``build_pipeline_program`` then ``plan_pipeshard``, as ``plan_train_step`` does
for a ``PipeshardParallel`` method, called directly so that tracing is timed apart from
planning and the layer costs can be shared with the pipeline baselines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from autopar.cluster import ClusterSpec, format_mesh_shape
from autopar.compiler.inter_op.layer_costs import LayerCostCache
from autopar.compiler.inter_op.stages import StagePartition
from autopar.ir.pipeline_program import PipelineProgram
from autopar.methods import PipeshardParallel
from autopar.models import ZooModel
from autopar.plan import MethodName, Plan


@dataclass
class Searched:
    """The full search's result for one model and cluster, with what the baselines reuse."""

    pp: PipelineProgram
    plan: Plan
    method: PipeshardParallel
    cache: LayerCostCache
    trace_s: float


def full_search(model: ZooModel, cluster: ClusterSpec, *, microbatches: int,
                pipeline_layers: int | str = "auto",
                memory_budget_bytes: float | None = None) -> Searched:
    """Trace ``model``'s train step (differentiated with ``autopar.value_and_grad``) at
    abstract shapes and plan it with ``PipeshardParallel`` on ``cluster``."""
    import autopar
    from autopar.compiler.planners.pipeshard import layer_cost_cache, plan_pipeshard
    from autopar.ir.pipeline_program import build_pipeline_program

    marked = model.with_value_and_grad(autopar.value_and_grad)
    method = autopar.PipeshardParallel(num_microbatches=microbatches, layers=pipeline_layers,
                                       memory_budget_bytes=memory_budget_bytes)
    start = time.perf_counter()
    pp = build_pipeline_program(marked.train_step, marked.abstract_inputs(), (1,),
                                microbatches)
    trace_s = time.perf_counter() - start
    cache = layer_cost_cache(method)
    plan = plan_pipeshard(pp, method, cluster, cache=cache)
    plan.batch_argnums = (1,)
    return Searched(pp, plan, method, cache, trace_s)


def planning_times(trace_s: float, plan: Plan) -> dict[str, float]:
    """Seconds by phase: ``trace_s``; ``ilp_s`` (every intra-operator ILP: the layers' costs
    and the chosen stages' own solves), ``dp_s`` (the stage DP without the ILPs it asked for),
    ``other_s`` (layer clustering) and ``total_s`` (trace included). A one-stage plan of the
    data or shard planner records one planning time: all ILP (shard) or none (data)."""
    timings = plan.planning.phases
    if not timings:
        planned = float(plan.planning.planning_time_s or 0.0)
        ilp = planned if plan.method is MethodName.SHARD else 0.0
        return {"trace_s": trace_s, "ilp_s": ilp, "dp_s": 0.0, "other_s": planned - ilp,
                "total_s": trace_s + planned}
    return {
        "trace_s": trace_s,
        "ilp_s": timings["stage_costs_s"] + timings["stage_plans_s"],
        "stage_cost_ilp_s": timings["stage_costs_s"],
        "stage_plan_ilp_s": timings["stage_plans_s"],
        "dp_s": timings["stage_dp_s"],
        "other_s": timings["layers_s"],
        "total_s": trace_s + timings["total_s"],
    }


def plan_summary(plan: Plan) -> dict[str, Any]:
    """Stages (layer range, submesh, logical mesh, estimated seconds per microbatch or per
    step), method, microbatches and schedule."""
    pipeline = plan.pipeline
    return {
        "method": plan.method.value,
        "num_stages": len(plan.stages),
        "num_microbatches": plan.num_microbatches,
        "schedule": None if pipeline is None else str(pipeline.schedule),
        "pipeline_layers": None if pipeline is None else len(pipeline.layer_positions) + 1,
        "est_idle_fraction": plan.planning.estimated_idle_fraction,
        "stages": [
            {"layers": [s.layers[0], s.layers[-1]] if s.layers else [],
             "submesh": list(s.submesh_shape),
             "logical_mesh": format_mesh_shape(s.logical_mesh_shape),
             "devices": len(s.device_ids),
             "est_time_s": s.est_time_s,
             "est_communication_time_s": s.est_communication_time_s}
            for s in plan.stages
        ],
    }


def partition_summary(partition: StagePartition) -> dict[str, Any]:
    """A stage partition (the DP's or a hand split) in ``plan_summary``'s stage layout."""
    return {
        "method": "pipeshard",
        "num_stages": len(partition.stages),
        "num_microbatches": partition.num_microbatches,
        "stages": [
            {"layers": [st.start, st.end - 1],
             "submesh": [st.submesh.num_hosts, st.submesh.devices_per_host],
             "logical_mesh": format_mesh_shape(st.candidate.logical_mesh_shape),
             "devices": st.submesh.num_devices,
             "est_time_s": st.candidate.time}
            for st in partition.stages
        ],
    }


def predicted_communication(plan: Plan) -> dict[str, Any]:
    """The plan's modelled communication: seconds per step summed over stages (a stage's per
    microbatch time times the microbatches), its share of the stages' summed time, and the
    predicted collectives by kind where the planner records them (data and shard plans; a
    pipelined plan keeps only the time)."""
    m = plan.num_microbatches
    comm = sum(s.est_communication_time_s for s in plan.stages) * m
    total = sum(s.est_time_s for s in plan.stages) * m
    kinds: dict[str, dict[str, float]] = {}
    for stage in plan.stages:
        if len(stage.device_ids) < 2:
            continue  # the plan lists the gradient's reduction; on one device it is no-op
        for c in stage.collectives:
            entry = kinds.setdefault(c.kind.value, {"count": 0, "bytes": 0.0, "time_s": 0.0})
            entry["count"] += c.count
            entry["bytes"] += c.nbytes
            entry["time_s"] += c.time_s
    return {"time_s": comm, "fraction": comm / total if total > 0 else 0.0,
            "collectives": kinds or None}


def same_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans choose the same stages, meshes and input shardings."""
    def shape(p: Plan) -> list[tuple]:
        return [(s.layers, s.submesh_shape, s.logical_mesh_shape) for s in p.stages]

    return shape(a) == shape(b) and a.shardings() == b.shardings()


def tflops_per_device(flops: float, step_s: float | None, devices: int) -> float | None:
    """``flops`` per step over ``step_s`` seconds on ``devices`` devices, in TFLOPS each."""
    if not step_s or step_s <= 0:
        return None
    return flops / step_s / devices / 1e12


def alpa_gpt_flops(config: Any, checkpoint_activations: bool = True) -> float:
    """Flops of one GPT train step as Alpa counts them (``compute_gpt_tflops`` in Alpa's
    benchmark utilities): 72 B S H^2 L (1 + S / 6H) + 6 B S H V, with 24 B S H^2 L (1 + S / 6H)
    more for the forward recomputed under rematerialisation."""
    b, s, h = config.batch_size, config.seq_len, config.hidden_size
    factor = 96 if checkpoint_activations else 72
    return (factor * b * s * h * h * config.num_layers * (1 + s / (6 * h))
            + 6 * b * s * h * config.vocab_size)
